"""examples/agent.py as a module, for the tests that drive it."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType


def load_agent() -> ModuleType:
    """A fresh copy of examples/agent.py each call (a test may patch its ``run_tool``)."""
    spec = importlib.util.spec_from_file_location("agent", Path(__file__).parents[1] / "examples" / "agent.py")
    agent = sys.modules["agent"] = importlib.util.module_from_spec(spec)  # (dataclasses look it up)
    spec.loader.exec_module(agent)
    return agent
