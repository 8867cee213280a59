"""deploy/netns_cluster.py as a module for the tests (deploy/ is not a package)."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

SCRIPT = Path(__file__).resolve().parents[1] / "deploy" / "netns_cluster.py"
_NAME = "netns_cluster"


def load_netns_cluster() -> ModuleType:
    """The module, loaded once per test process."""
    if _NAME not in sys.modules:
        spec = importlib.util.spec_from_file_location(_NAME, SCRIPT)
        module = importlib.util.module_from_spec(spec)
        sys.modules[_NAME] = module  # dataclasses resolve their module by name
        spec.loader.exec_module(module)
    return sys.modules[_NAME]
