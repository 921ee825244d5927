"""The developer tools of scripts/dev/ (outside the package) as modules, for the tests that check them."""
import importlib.util
import sys
from pathlib import Path

DEV = Path(__file__).resolve().parents[1] / "scripts" / "dev"


def load(name: str):
    """scripts/dev/NAME.py, imported once as the module `dev_NAME`."""
    key = f"dev_{name}"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, DEV / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[key] = module
        spec.loader.exec_module(module)
    return sys.modules[key]
