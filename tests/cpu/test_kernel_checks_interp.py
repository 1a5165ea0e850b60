"""Every kernel check module (tests/kernel_checks.py: fp8_block, mxfp8 and nvfp4 quantizers and
GEMMs, the Mega forward) under Triton's CPU interpreter against the torch twins, small shapes.
One child process runs with TRITON_INTERPRET=1 (this file run as a script); each test reports
one check.

    TRITON_INTERPRET=1 python tests/cpu/test_kernel_checks_interp.py [module:check ...]
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

from megatron_dist_moe import testing as tt

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
import kernel_checks as KC  # noqa: E402

CHECKS = KC.all_checks(interpreter=True)


def _main(names):
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    import torch
    for name in names or CHECKS:
        torch.manual_seed(0)
        t0 = time.time()
        try:
            CHECKS[name]("cpu")
            res = {"name": name, "ok": True}
        except Exception as ex:
            import traceback
            res = {"name": name, "ok": False, "error": f"{type(ex).__name__}: {ex}",
                   "trace": traceback.format_exc()[-3000:]}
        res["seconds"] = round(time.time() - t0, 2)
        print("RESULT " + json.dumps(res), flush=True)


@pytest.fixture(scope="module")
def results():
    pytest.importorskip("triton")
    return tt.run_child_checks([__file__], timeout_s=1800, paths=(str(HERE.parent),))[0]


@pytest.mark.parametrize("name", list(CHECKS))
def test_kernel_check_interpreter(results, name):
    tt.assert_child_check(results, name)


if __name__ == "__main__":
    _main(sys.argv[1:])
