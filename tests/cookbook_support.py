"""tinker-cookbook for the Tinker-service test, beside the project's venv without its pins.

The cookbook's pins do not install beside ours: 0.6.1 needs tml-renderers>=0.4.1 (absent from the registry reachable
here) and 0.5.x pins transformers<=5.5.4 (we run 5.24). Installed `--no-deps` into its own site folder, 0.5.8 and
the few packages it imports that the project lacks run on the project's transformers, torch and tinker: the test
puts the folder on the driver's PYTHONPATH only (tests/cookbook_driver.py runs in a child process).

    .venv/bin/python tests/cookbook_support.py      # install (what `make test` needs once; idempotent)
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SITE = ROOT / ".venv-cookbook"
PACKAGES = ("tinker-cookbook==0.5.8", "tml-renderers==0.2.1", "chz==0.4.0", "blobfile==3.3.0", "lxml==6.1.3",
            "pyrage==1.4.0", "tiktoken==0.14.0", "termcolor==3.3.0", "cloudpickle==3.1.3")


def cookbook_site() -> Path:
    """The site folder holding the cookbook (installed at the first call, again when PACKAGES change)."""
    stamp = SITE / ".packages"
    want = "\n".join(PACKAGES)
    if not stamp.is_file() or stamp.read_text() != want:
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--upgrade", "--target",
                        str(SITE), *PACKAGES], check=True)
        stamp.write_text(want)
    return SITE


if __name__ == "__main__":
    print(cookbook_site())
