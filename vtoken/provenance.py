"""What every results file records about the run that made it: versions, commit, device and date."""

from __future__ import annotations

import datetime as _dt
import platform
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]  # a source checkout's root (the package's parent directory)


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def commit() -> dict:
    """{"commit": the checkout's HEAD or None (an installed wheel), "dirty": uncommitted changes or None}."""
    if not (REPO / ".git").exists():
        return {"commit": None, "dirty": None}
    head = _git("rev-parse", "HEAD")
    status = _git("status", "--porcelain", "--untracked-files=no")
    return {"commit": head, "dirty": None if status is None else bool(status)}


def run_info(device: object = "cpu") -> dict:
    """Versions (vtoken, Python, torch, transformers, lmms-eval when installed), commit, device, the machine and
    the date (UTC, ISO 8601), for a results JSON."""
    import torch

    import vtoken
    from vtoken.adapters import hf

    info = {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "vtoken": vtoken.__version__,
        **commit(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": str(hf.INSTALLED),  # adapters/hf.py is the one reader of this version
        "platform": platform.platform(),
        "device": str(device),
    }
    try:
        from importlib.metadata import version

        info["lmms_eval"] = version("lmms_eval")
    except Exception:  # noqa: BLE001 (not installed: nothing to record)
        pass
    device = torch.device(device)
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    else:
        info["cpu"] = platform.processor() or platform.machine()
        info["cpu_threads"] = torch.get_num_threads()
    return info
