"""python -m examples.digits {build,quickstart,benchmark,report}: see examples/digits/README.md."""
import argparse
import sys

from examples.digits import bench, model, report


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m examples.digits",
                                description=model.__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="pretrain the digits pipeline and classifier (or reuse "
                       "the one in VGRPO_DIGITS_CACHE, by default the committed model/)")
    b.add_argument("--pretrain_steps", type=int, default=1500)
    b.add_argument("--force", action="store_true", help="rebuild even if the cache matches")
    q = sub.add_parser("quickstart", help="train 30 V-GRPO iterations, before/after grid")
    q.add_argument("--iterations", type=int, default=30)
    q.add_argument("--run_dir", default="runs/digits-quickstart")
    q.add_argument("--grid", default="runs/digits-quickstart/before_after.png")
    q.add_argument("--seed", type=int, default=0)
    bench.add_commands(sub)
    report.add_command(sub)
    a = p.parse_args(argv)
    try:
        if a.cmd == "build":
            model.build(pretrain_steps=a.pretrain_steps, force=a.force)
        elif a.cmd == "quickstart":
            model.quickstart(a.iterations, a.run_dir, a.seed, a.grid)
        elif a.cmd == "report":
            report.run_command(a)
        else:
            bench.run_command(a)
    except (ValueError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
