"""A tensor-parallel worker process: `python -m vegas_spec.worker`, started by `launch` with
RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT and VEGAS_TP_DEVICE in its
environment. It joins the group and makes rank 0's model-runner calls (a step: one plan) on
its own runner until rank 0 says stop (exit 0) or goes away (its next receive fails: exit
1)."""

from __future__ import annotations

import os
import sys


def main() -> int:
    from vegas_spec import executor

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    try:
        channel = executor.init_group(rank, world, os.environ.get("VEGAS_TP_DEVICE", "cpu"))
        executor.serve(channel)
    except KeyboardInterrupt:
        return 130
    except Exception as err:  # noqa: BLE001 - one line, then the exit code rank 0 reports
        print(f"vegas: worker rank {rank}: {type(err).__name__}: {err}", file=sys.stderr,
              flush=True)
        return 1
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # no teardown of the group: rank 0 may be gone
