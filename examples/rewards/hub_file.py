"""The weights file of a plug-in reward (examples/rewards/aesthetic.py, examples/rewards/hpsv2.py),
named by an environment variable: a local file, or owner/repo/path/in/repo fetched from the hub
(cached)."""
import os


def hub_file(location: str, variable: str) -> str:
    """`location` as a local file: itself, or downloaded with huggingface_hub. A failure (offline,
    a missing file, no permission) is one RuntimeError that says how to get the file by hand."""
    if os.path.isfile(location):
        return location
    owner, repo, file = (location.split("/", 2) + ["", ""])[:3]
    try:
        from huggingface_hub import hf_hub_download
        return hf_hub_download(f"{owner}/{repo}", file)
    except Exception as e:  # noqa: BLE001 — offline, missing file, no permission: one message
        raise RuntimeError(f"could not fetch {variable} {location!r} ({type(e).__name__}); "
                           f"download it (`hf download {owner}/{repo} {file}`) and "
                           f"set {variable}=/path/to/file") from None
