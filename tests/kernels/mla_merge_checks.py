"""Interpreter checks (fp32) of the MLA decode's lse output and the lse merge; run by
test_mla_merge.py in a subprocess with TRITON_INTERPRET=1."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kernel_checks  # noqa: E402

if __name__ == "__main__":
    kernel_checks.run_mla_merge_suite()
    print("ok")
