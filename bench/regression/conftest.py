"""pytest-benchmark hooks of the regression set: record what a baseline was measured on."""

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/, for gate.py

from gate import device_name  # noqa: E402


def pytest_benchmark_update_machine_info(config, machine_info):
    # The device the set timed (the GPU when there is one), the load while it ran (a shared machine's noise
    # shows here), and the library versions the medians depend on.
    machine_info["device"] = device_name()
    machine_info["loadavg_1_5_15"] = list(os.getloadavg())
    machine_info["torch"] = torch.__version__
    machine_info["torch_threads"] = torch.get_num_threads()
