"""Run hostile inputs in a subprocess with a memory cap (the fuzz harness of issue 66).

`run_capped(setup, body)` starts a fresh interpreter, runs `setup` (imports, fixtures), then
caps the address space at what the process maps then plus `cap_mb`, and runs `body`. The body
calls `case(name, fn)` for each input: fn() either returns (accepted) or raises one of
`EXPECTED` (a clear refusal: its message is kept); anything else is a traceback, and a
MemoryError means the input cost more than the cap. The result also has the peak resident
set above the baseline taken after setup (VmHWM), so a test can assert both.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

_PRELUDE = '''
import json, resource, sys, traceback

def _status(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0

_results = []

def case(name, fn):
    try:
        fn()
        _results.append([name, "ok", None])
    except MemoryError:
        _results.append([name, "memory", traceback.format_exc()[-600:]])
    except EXPECTED as exc:
        msg = str(exc) if not isinstance(exc, SystemExit) else f"exit {exc.code}"
        _results.append([name, "error", msg[:300]])
    except BaseException:
        _results.append([name, "traceback", traceback.format_exc()[-1500:]])
'''

_CAP = '''
_base_hwm = _status("VmHWM")
_cap = _status("VmSize") + CAP_MB * (1 << 20)
resource.setrlimit(resource.RLIMIT_AS, (_cap, resource.getrlimit(resource.RLIMIT_AS)[1]))
'''

_EPILOGUE = '''
print("\\n@@RESULT@@" + json.dumps({"results": _results, "hwm_mb": (_status("VmHWM") - _base_hwm) / 2**20}))
'''


def run_capped(setup: str, body: str, cap_mb: int = 256, timeout: float = 300.0,
               expected: str = "(ValueError, OSError, SystemExit)") -> dict:
    """{"results": [[name, "ok"|"error"|"traceback"|"memory", detail], ...], "hwm_mb": float}."""
    # (EXPECTED after setup: it may name the error classes setup imports)
    src = (_PRELUDE + f"\nCAP_MB = {cap_mb}\n" + textwrap.dedent(setup) + f"\nEXPECTED = {expected}\n"
           + _CAP + textwrap.dedent(body) + _EPILOGUE)
    p = subprocess.run([sys.executable, "-c", src], capture_output=True, text=True, timeout=timeout)
    out = p.stdout.rpartition("@@RESULT@@")[2]
    if p.returncode != 0 or not out:
        raise AssertionError(f"capped run failed (exit {p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    return json.loads(out)


def bad_results(got: dict) -> list:
    """The cases that gave a traceback or ran out of memory."""
    return [r for r in got["results"] if r[1] not in ("ok", "error")]
