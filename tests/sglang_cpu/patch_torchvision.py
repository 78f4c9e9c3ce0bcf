"""Test support: make PyPI's torchvision importable beside the CPU torch in the SGLang test
environment (`make sglang` runs this on machines without an NVIDIA driver).

PyPI's torchvision for Linux is a CUDA build; its compiled ops cannot load beside torch's CPU
build, and two fake-kernel registrations (`nms`, `qnms`) in `_meta_registrations.py` then fail at
import. SGLang imports torchvision for its vision models' configs, so a text-only server needs
the module to import, not its ops: register those two fakes only when the ops exist (as the file
already does for every other op). Idempotent.
"""

import sys
from pathlib import Path

target = Path(sys.argv[1]) / "torchvision" / "_meta_registrations.py"
text = target.read_text()
for op in ("nms", "qnms"):
    old = f'@torch.library.register_fake("torchvision::{op}")'
    new = (
        f'@(torch.library.register_fake("torchvision::{op}") if torchvision.extension._has_ops() else (lambda fn: fn))'
    )
    if new not in text:
        if old not in text:
            sys.exit(f"{target}: no {old!r} to patch (torchvision changed; update this script)")
        text = text.replace(old, new)
target.write_text(text)
print(f"patched {target}")
