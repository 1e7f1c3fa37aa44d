"""The front door's half of `mmpipe check`: mmpipe.cli checks and launches the ranks as `mmpipe train`
does (mmpipe.cli.cmd_train with the rank entry mmpipe.check.rank); the exit status comes from the
check.json rank 0 wrote: 0 every check passed, 1 naming each failed one."""
from __future__ import annotations

import json
import sys
from pathlib import Path

CHECK_FILE = "check.json"


def check_verdict(out: Path, launcher_rc: int) -> int:
    path = out / CHECK_FILE
    if not path.is_file():
        print(f"mmpipe: error: the check ranks stopped before writing {path} (launcher exit {launcher_rc}); the "
              f"first traceback above says why", file=sys.stderr, flush=True)
        return launcher_rc or 1
    failed = json.loads(path.read_text())["failed"]
    if failed:
        print(f"mmpipe: check failed: {', '.join(failed)} (details in {path})", file=sys.stderr, flush=True)
        return 1
    print(f"mmpipe: check passed; {path}", flush=True)
    return 0
