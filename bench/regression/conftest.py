"""pytest-benchmark hooks of the regression set: record what a baseline was measured on."""

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/, for gate.py

from gate import device_name  # noqa: E402


def pytest_benchmark_update_machine_info(config, machine_info):
    # What the medians depend on; pytest-benchmark warns under --benchmark-compare when any of it differs from
    # the baseline's, so nothing that changes from run to run belongs here.
    machine_info["device"] = device_name()
    machine_info["torch"] = torch.__version__
    machine_info["malloc_env"] = {k: v for k, v in os.environ.items() if k.startswith("MALLOC_")}


def pytest_benchmark_update_json(config, benchmarks, output_json):
    # The load while the set ran: a shared machine's noise shows here, next to the figures it blurred.
    output_json["loadavg_1_5_15"] = [round(x, 2) for x in os.getloadavg()]
