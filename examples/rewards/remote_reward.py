"""A reward served by another process or environment, over HTTP, in the protocol of Flow-GRPO's
reward server [peer X10], so its GenEval and DeQA servers plug in unchanged:

    # in the server's own environment (github.com/yifan123/reward-server, port 18085 in its
    # gunicorn.conf.py): gunicorn "app_geneval:create_app()"
    python vgrpo.py --model sd3.5-medium --preset geneval-stage --prompts geneval_train.jsonl \
        --reward http://127.0.0.1:18085/geneval

vgrpo.py hands a reward spec that starts with http:// or https:// to `client(url)`, which returns
`score(images, prompts) -> (N,)` CPU fp32. `url` is http(s)://HOST:PORT[/PREFIX]/NAME.

The protocol [peer X10] (server: yifan123/reward-server `app_geneval.py`, `app_deqa.py`;
client: yifan123/flow_grpo `flow_grpo/rewards.py`, `geneval_score`, `deqa_score_remote`,
`unifiedreward_score_remote`):
  * request: POST to the server's root path "/" (the URL without NAME). The body is
    `pickle.dumps(dict)`, sent with "Content-Type: application/octet-stream" (flow_grpo's
    requests call sends none; the apps read the raw body, `request.get_data()`, whatever the
    type says): "images" is a list of JPEG bytes (the images as
    uint8, saved by PIL with format="JPEG" at its default quality, as flow_grpo does; the
    server opens them with `formats=["jpeg"]`, so PNG is refused), "meta_datas" is a list of
    each prompt's `.metadata` dict (None for a prompt without one), "only_strict" is a bool, and
    "prompts" is a list of plain str. Each server reads the keys it needs and ignores the rest,
    so one body serves every NAME.
  * answer: HTTP 200 with `pickle.dumps(dict)` of lists of floats, or HTTP 500 with the
    server's traceback as UTF-8 text.
  * NAME picks which field of the answer is the reward, and whether metadata is required:
      geneval           "scores": GenEval partial credit in [0, 1], flow_grpo's training reward
                        (needs GenEval metadata: .jsonl prompts with "tag", "include", ...)
      geneval_strict    "strict_rewards": 1 if every requirement is met, else 0 (needs metadata)
      geneval_accuracy  "rewards": the original GenEval rule, 1/0; the only NAME that sends
                        only_strict=False (flow_grpo's evaluation setting; it costs server time)
      deqa              "outputs": DeQA-Score / 5
      any other NAME    "outputs", the field of every reward-server app except GenEval's
                        (flow_grpo's `unifiedreward_score_remote` reads it too)
  Batches of REMOTE_REWARD_BATCH images (default 64, flow_grpo's batch_size) go one request each.

Safety. The protocol is pickle, and unpickling can run code. The answer is unpickled by an
Unpickler that resolves only builtin containers and numbers, collections' dict types and numpy
arrays/scalars (what the servers send: lists of Python floats and dicts of lists); any other
global in the answer (os.system, a class) is refused and reported as a bad answer. Neither can a
small answer make the client allocate much: an answer is read up to REMOTE_REWARD_MAX_BYTES
(default 8 MiB; a GenEval answer for 64 images is about 6 KB), and the constructors that
allocate from a number alone (bytes(n), bytearray(n), numpy's _reconstruct of a non-empty
shape: a real array pickle starts empty) are refused before they run. Text from the server
(an HTTP error's last line, names in a bad pickle) reaches the terminal with its control
characters replaced by "?", so it cannot move the cursor or recolour the screen. A URL with a
user name or password (http://USER:PASSWORD@HOST/...) is refused without printing it: the
protocol sends no credentials. Point REMOTE URLs only at servers you run: this client pickles
your prompts and metadata to them.

Failures: each is one line naming the URL (vgrpo.py shows it as the reward's error), raised as
RemoteRewardError. A connection that fails or an HTTP 5xx is retried, REMOTE_REWARD_TRIES times in
all (default 3; flow_grpo retries HTTP 500 up to 1000 times), waiting REMOTE_REWARD_BACKOFF ·
2^k seconds between tries (default 1 → 1 s, 2 s). Each request (each try) also has a deadline
for the whole of it, connecting, sending, waiting and reading, so a server that keeps sending a
byte now and then is cut off too. A read timeout or a passed deadline is not retried (the
server is up and busy; a second request would queue behind the first). Environment:
    REMOTE_REWARD_CONNECT_TIMEOUT  seconds to open the connection (default 10)
    REMOTE_REWARD_READ_TIMEOUT     seconds the server may stay silent while scoring (default 120,
                                   flow_grpo's timeout and gunicorn.conf.py's worker timeout)
    REMOTE_REWARD_DEADLINE         seconds one request may take in all (default
                                   CONNECT_TIMEOUT + 2 × READ_TIMEOUT: 250 s)
    REMOTE_REWARD_MAX_BYTES        the largest answer read, in bytes (default 8 MiB)
    REMOTE_REWARD_TRIES, REMOTE_REWARD_BACKOFF, REMOTE_REWARD_BATCH  as above
"""
import http.client
import io
import math
import numbers
import os
import pickle
import socket
import ssl
import sys
import threading
import time
from urllib.parse import urlsplit

import torch

# NAME → (answer field that is the reward, metadata required, only_strict sent) [peer X10]
FIELDS = {"geneval": ("scores", True, True),
          "geneval_strict": ("strict_rewards", True, True),
          "geneval_accuracy": ("rewards", True, False)}
DEFAULT_FIELD = ("outputs", False, True)

# The globals an answer may name. Python's None/bool/int/float/str/list/dict/tuple need none; the
# rest is what numpy (1.x "numpy.core", 2.x "numpy._core") and older protocols emit.
_SAFE_GLOBALS = {("builtins", n) for n in ("dict", "list", "tuple", "set", "frozenset", "str",
                                           "bytes", "bytearray", "int", "float", "complex", "bool")}
_SAFE_GLOBALS |= {("collections", "OrderedDict"), ("collections", "defaultdict"),
                  ("_codecs", "encode"), ("numpy", "ndarray"), ("numpy", "dtype")}
_SAFE_GLOBALS |= {(f"numpy.{core}.{mod}", fn) for core in ("core", "_core") for mod, fn in
                  (("multiarray", "_reconstruct"), ("multiarray", "scalar"),
                   ("numeric", "_frombuffer"))}


class RemoteRewardError(RuntimeError):
    """A reward server that is down, too slow, or answered something that is not scores."""


class _PastDeadline(Exception):
    """A request that was still under way when its deadline passed (cut off by post_once)."""


class _TooLarge(Exception):
    """An answer longer than REMOTE_REWARD_MAX_BYTES (post_once stops reading it)."""


def _printable(text: str) -> str:
    """text with every control character (ESC, CR, BEL, C1 codes, ...) replaced by "?"."""
    return "".join(c if c.isprintable() else "?" for c in text)


def _guarded(make):
    """make(...) for the unpickler, refused before it runs where a few bytes could allocate much
    (bytes(10**9), bytearray(n), numpy's _reconstruct of a non-empty shape: a real array pickle
    starts empty) or crash the process (numpy does not check an object array's state: only
    numbers' dtypes, booleans to floats, are made)."""
    def checked(*args):
        name = make.__name__
        if name == "dtype":
            ok = args and isinstance(args[0], str) and args[0][:1] in ("b", "i", "u", "f")
        elif name == "_reconstruct":
            shape = args[1] if len(args) > 1 else ()
            ok = isinstance(shape, (tuple, list)) and not any(shape)
        else:
            ok = not (args and isinstance(args[0], numbers.Integral))
        if not ok:
            raise pickle.UnpicklingError(f"{name}{args!r:.60} is refused: it would allocate "
                                         "memory from a number, or make an object array")
        return make(*args)
    return checked


class _AnswerUnpickler(pickle.Unpickler):
    """pickle.Unpickler that resolves only _SAFE_GLOBALS: data, never code."""

    def find_class(self, module, name):
        key = ("builtins" if module == "__builtin__" else module, name)   # protocols 0-2's name
        if key not in _SAFE_GLOBALS:
            raise pickle.UnpicklingError(f"forbidden global {module}.{name}")
        found = super().find_class(module, name)
        if name in ("bytes", "bytearray", "_reconstruct", "dtype"):  # 46 bytes → 1 GB
            return _guarded(found)
        return found


def _env(name: str, default: float) -> float:
    value = os.environ.get(name, "")
    try:
        return float(value) if value else default
    except ValueError:
        raise RemoteRewardError(f"{name}={value!r} is not a number") from None


def jpeg_bytes(images: torch.Tensor) -> list[bytes]:
    """(N, 3, H, W) in [0, 1] → N JPEG files, as flow_grpo encodes them for the server [peer X10]:
    uint8 by round-and-clamp, PIL's default JPEG quality (75)."""
    from PIL import Image
    u8 = (images.detach().float().cpu() * 255).round().clamp(0, 255).to(torch.uint8)
    out = []
    for im in u8.permute(0, 2, 3, 1).numpy():                               # (H, W, 3) each
        buf = io.BytesIO()
        Image.fromarray(im).save(buf, format="JPEG")
        out.append(buf.getvalue())
    return out


def client(url: str):
    """The score function of the reward server at `url` = http(s)://HOST:PORT[/PREFIX]/NAME.
    Raises RemoteRewardError (one line) for a URL it cannot use; nothing is sent until a call."""
    parts = urlsplit(url)
    if "@" in parts.netloc:                      # never printed, never sent
        raise RemoteRewardError(f"reward URL {parts.scheme}://…@{parts.netloc.rsplit('@')[-1]}"
                                "/…: holds a user name or password, which this protocol never "
                                "sends; drop the 'USER:PASSWORD@'")
    prefix, _, name = parts.path.rpartition("/")
    if parts.scheme not in ("http", "https") or not parts.hostname or not name \
            or parts.query or parts.fragment:
        raise RemoteRewardError(f"reward URL {url!r}: expected http(s)://HOST:PORT/NAME, "
                                f"NAME one of {', '.join(FIELDS)}, deqa, ...")
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        raise RemoteRewardError(f"reward URL {url!r}: the port is not a number") from None
    path = prefix + "/"                          # the reward-server apps serve POST "/" [peer X10]
    field, needs_metadata, only_strict = FIELDS.get(name, DEFAULT_FIELD)
    connect_s = _env("REMOTE_REWARD_CONNECT_TIMEOUT", 10.0)
    read_s = _env("REMOTE_REWARD_READ_TIMEOUT", 120.0)
    deadline_s = _env("REMOTE_REWARD_DEADLINE", connect_s + 2 * read_s)
    if not deadline_s > 0:
        raise RemoteRewardError(f"REMOTE_REWARD_DEADLINE={deadline_s:g}: give seconds > 0")
    tries = max(1, int(_env("REMOTE_REWARD_TRIES", 3)))
    backoff = _env("REMOTE_REWARD_BACKOFF", 1.0)
    batch = max(1, int(_env("REMOTE_REWARD_BATCH", 64)))
    max_bytes = int(_env("REMOTE_REWARD_MAX_BYTES", 8 * 2 ** 20))

    def fail(what: str):
        return RemoteRewardError(f"reward server {url}: " + _printable(" ".join(what.splitlines())))

    def post_once(body: bytes) -> tuple[int, bytes]:
        """One POST, all of it within deadline_s; (status, body). Raises _PastDeadline once the
        deadline has passed, else OSError or HTTPException for a connection that failed; a
        socket.timeout (an OSError) while waiting for the answer is tagged .phase = "read"."""
        timeout = min(connect_s, deadline_s)
        if parts.scheme == "https":
            conn = http.client.HTTPSConnection(parts.hostname, port, timeout=timeout,
                                               context=ssl.create_default_context())
        else:
            conn = http.client.HTTPConnection(parts.hostname, port, timeout=timeout)
        lock, state = threading.Lock(), {"over": False, "passed": False}

        def cut_off():                        # the timer's thread, at the deadline: a blocked
            with lock:                        # send or receive returns at once
                if state["over"]:
                    return
                state["passed"] = True
                if conn.sock is not None:
                    try:
                        conn.sock.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass

        timer = threading.Timer(deadline_s, cut_off)
        timer.daemon = True
        timer.start()
        try:
            conn.connect()                                    # bounded by connect_s
            conn.sock.settimeout(read_s)                      # then each read by read_s
            try:
                with lock:
                    if state["passed"]:                       # during the connection
                        raise _PastDeadline
                conn.request("POST", path, body=body,
                             headers={"Content-Type": "application/octet-stream"})
                resp = conn.getresponse()
                length = resp.getheader("Content-Length", "")
                if length.isdigit() and int(length) > max_bytes:  # refused before reading
                    raise _TooLarge(int(length))
                status, data = resp.status, resp.read(max_bytes + 1)
                if len(data) > max_bytes:                     # no length, or a false one
                    raise _TooLarge(None)
            except socket.timeout as e:
                e.phase = "read"
                raise
        except (OSError, http.client.HTTPException):
            if state["passed"]:
                raise _PastDeadline from None
            raise
        finally:
            with lock:
                state["over"] = True
            timer.cancel()
            conn.close()
        if state["passed"]:                   # an answer without a length, cut short
            raise _PastDeadline
        return status, data

    def post(body: bytes) -> bytes:
        """POST with bounded retries on a failed connection and on HTTP 5xx; the answer's bytes."""
        start = time.monotonic()
        for k in range(tries):
            if k:
                time.sleep(backoff * 2 ** (k - 1))
            try:
                status, data = post_once(body)
            except _TooLarge as e:
                size = f"{e.args[0]} bytes" if e.args[0] else "more"
                raise fail(f"answered {size}, more than REMOTE_REWARD_MAX_BYTES={max_bytes} "
                           "(a reward answer is a few KB); raise it if the server is right") from None
            except _PastDeadline:
                raise fail(f"no complete answer within REMOTE_REWARD_DEADLINE={deadline_s:g} s "
                           "(the whole request: connecting, sending, waiting and reading); raise "
                           "it if the server is only slow") from None
            except (OSError, http.client.HTTPException) as e:   # refused, reset, DNS, TLS,
                if getattr(e, "phase", "") == "read":              # timeouts, not HTTP at all
                    raise fail(f"no answer within REMOTE_REWARD_READ_TIMEOUT={read_s:g} s; raise "
                               "it if the server is only slow") from None
                why = "timed out" if isinstance(e, socket.timeout) else (
                    getattr(e, "strerror", None) or type(e).__name__)
                last = f"connection failed ({why})"
            else:
                if status == 200:
                    return data
                text = data.decode("utf-8", "replace").strip().splitlines()
                last = f"HTTP {status}" + (f" ({_printable(text[-1][:200])})" if text else "")
                if status < 500:                         # a wrong path or method: no retry
                    raise fail(f"answered {last} to POST {path}; the reward-server apps serve "
                               "POST / only, i.e. the URL http://HOST:PORT/NAME")
            if k + 1 < tries:
                print(f"reward server {url}: {last}; try {k + 2} of {tries}", file=sys.stderr)
        raise fail(f"{last} after {tries} tries in {time.monotonic() - start:.1f} s; is it "
                   "running (yifan123/reward-server), and are HOST and PORT right?")

    def parse(data: bytes, n: int) -> list[float]:
        """The answer's reward field as n finite floats, or one line saying what is wrong."""
        try:
            answer = _AnswerUnpickler(io.BytesIO(data)).load()
        except Exception as e:  # noqa: BLE001 — any unpickling failure is a bad answer
            raise fail(f"the answer is not a pickle of data ({type(e).__name__}: {e}; first bytes "
                       f"{data[:40]!r})") from None
        if not isinstance(answer, dict) or field not in answer:
            keys = sorted(map(str, answer)) if isinstance(answer, dict) else type(answer).__name__
            raise fail(f"the answer has no {field!r} (got {keys}); is NAME right for this server?")
        values = answer[field]
        if hasattr(values, "tolist"):                 # a numpy array
            values = values.tolist()
        if not isinstance(values, (list, tuple)):
            raise fail(f"the answer's {field!r} is a {type(values).__name__}, not a list")
        if len(values) != n:
            raise fail(f"the answer's {field!r} holds {len(values)} values for {n} images")
        for i, v in enumerate(values):
            if not isinstance(v, numbers.Real) or not math.isfinite(v):
                raise fail(f"the answer's {field!r}[{i}] is {v!r}, not a finite number")
        return [float(v) for v in values]

    def check_prompts(prompts: list) -> None:
        """ValueError naming the first prompt without the metadata this NAME needs."""
        if needs_metadata:
            for p in prompts:
                if not isinstance(getattr(p, "metadata", None), dict):
                    raise ValueError(f"{name} at {url} needs each prompt's metadata, and prompt "
                                     f"{str(p)[:60]!r} has none; pass a .jsonl prompt file "
                                     "(GenEval's train_metadata.jsonl lines)")

    def score(images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        """images (N, 3, H, W) in [0, 1], N prompts → (N,) the server's `field`, CPU fp32."""
        check_prompts(prompts)
        out = []
        for i in range(0, len(prompts), batch):
            ps = prompts[i:i + batch]
            body = pickle.dumps({"images": jpeg_bytes(images[i:i + batch]),
                                 "meta_datas": [getattr(p, "metadata", None) for p in ps],
                                 "only_strict": only_strict,
                                 "prompts": [str(p) for p in ps]},     # plain str: the server
                                protocol=4)                            # cannot import vgrpo.Prompt
            out += parse(post(body), len(ps))
        return torch.tensor(out, dtype=torch.float32)

    score.check_prompts = check_prompts
    return score
