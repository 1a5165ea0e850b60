"""the Mega forward kernel (kernels/grouped_gemm/mega.py) under Triton's CPU
interpreter against their torch twins: tests/mega_kernel_checks.py, small shapes. The child
process runs with TRITON_INTERPRET=1 (this file run as a script); each test reports one check.

    TRITON_INTERPRET=1 python tests/cpu/test_kernels_mega_interp.py [check ...]
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
import mega_kernel_checks as C  # noqa: E402


def _main(names):
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    import torch
    for name in names or C.CHECKS:
        torch.manual_seed(0)
        t0 = time.time()
        try:
            C.CHECKS[name]("cpu")
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
    return tt.run_child_checks([__file__], timeout_s=900, paths=(str(HERE.parent),))[0]


@pytest.mark.parametrize("name", list(C.CHECKS))
def test_mega_kernel_interpreter(results, name):
    res = results.get(name)
    assert res is not None, f"check {name} did not report (child crashed?)"
    assert res["ok"], f"{res['error']}\n{res.get('trace', '')}"


if __name__ == "__main__":
    _main(sys.argv[1:])
