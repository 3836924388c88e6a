"""Training code imports the TITO training API with numpy alone: no tokenizer, template engine, RPC or router."""

from __future__ import annotations

import json
import subprocess
import sys

HEAVY = ("jinja2", "tokenizers", "grpc", "httpx", "psrl.router", "psrl.tokenizer", "psrl.tito.store")

PROBE = f"""
import json, sys
from psrl.tito import build_training_arrays, build_all_training_arrays, TrainingArrays, Snapshot
heavy = {HEAVY!r}
print(json.dumps(sorted(m for m in sys.modules if any(m == h or m.startswith(h + ".") for h in heavy))))
"""


def test_training_api_imports_without_the_gateway() -> None:
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120, check=True)
    assert json.loads(done.stdout) == []


def test_the_store_is_still_importable_from_the_package() -> None:
    from psrl.tito import TitoStore
    from psrl.tito.store import TitoStore as FromStore

    assert TitoStore is FromStore
