"""Experiment tracking: the run's metrics fanned out to JSONL, TensorBoard and Weights & Biases ([logging] backends).

One `MultiLogger` per phase (SFT, RL) built by `build_logger`: the JSONL log always (the plot, the summary and
--resume read it), a TensorBoard writer on <output_dir>/tensorboard/<phase>, and one W&B run per phase, named
<run_name>-<phase> in the group <run_name> (W&B wants a run's steps to increase, and each phase counts from 1).
tensorboard and wandb are optional extras (`pip install 'rlkernels[tracking]'`): they are imported only when a
backend is built, and `check_backends` turns a missing one into a config error before any work.
Metrics reach a logger as host numbers; the non-numeric ones (text, None) stay in metrics.jsonl only.
"""

from __future__ import annotations

import contextlib
import netrc
import numbers
import os
from collections.abc import Mapping, Sequence
from importlib.util import find_spec
from pathlib import Path
from typing import Any, Protocol, runtime_checkable
from urllib.parse import urlsplit

from trainer.config import ConfigError, LoggingConfig
from trainer.metrics import JSONLLogger, MetricsLogger

# backend -> the package it imports (jsonl needs none); the extra `tracking` installs both
_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb"}


def check_backends(backends: Sequence[str]) -> None:
    """Raise ConfigError for a backend whose package is not installed, before the run builds anything. find_spec
    locates the package without importing it (importing wandb alone takes a few tenths of a second)."""
    for backend in backends:
        package = _PACKAGES.get(backend)
        if package is not None and find_spec(package) is None:
            raise ConfigError(f'[logging] backends: "{backend}" needs the {package} package: '
                              f"pip install 'rlkernels[tracking]' (or pip install {package})")


def _numbers(metrics: Mapping[str, Any]) -> dict[str, int | float]:
    """The metrics a chart can show: real numbers (numpy scalars too), bools as 0/1; nan and inf are kept (a
    diverging loss should show as one)."""
    return {k: int(v) if isinstance(v, bool) else v for k, v in metrics.items() if isinstance(v, numbers.Real)}


@runtime_checkable
class TableLogger(MetricsLogger, Protocol):
    """A logger that also shows tables (a few rollout samples); JSONLLogger is not one."""

    def log_table(self, step: int, name: str, rows: list[dict[str, Any]]) -> None: ...


def _columns(rows: list[dict[str, Any]]) -> list[str]:
    """Every key of every row, in order of first appearance (rows may lack keys)."""
    return list(dict.fromkeys(k for row in rows for k in row))


def _markdown_cell(v: Any) -> str:
    # a completion holds newlines and may hold pipes: either would break the table's row
    return "" if v is None else str(v).replace("|", "\\|").replace("\r", "").replace("\n", "<br>")


def markdown_table(rows: list[dict[str, Any]]) -> str:
    """rows as a GitHub-flavoured markdown table (what TensorBoard's text tab renders)."""
    cols = _columns(rows)
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(_markdown_cell(row.get(c)) for c in cols) + " |" for row in rows]
    return "\n".join(lines)


class TensorBoardLogger:
    """Scalars and text through torch.utils.tensorboard.SummaryWriter on `log_dir` (one directory per phase).

    `keep_through`: the step this attempt starts after (0 fresh, the checkpoint's step on resume). The writer then
    opens with purge_step = keep_through + 1: TensorBoard drops the events of steps >= that left by an earlier
    attempt in the same directory, as truncate_jsonl does for metrics.jsonl. None keeps everything.
    `config_text`: the run's resolved TOML, recorded as text "config" at the step the attempt starts from."""

    def __init__(self, log_dir: str | os.PathLike, *, keep_through: int | None = None,
                 config_text: str | None = None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = Path(log_dir)
        purge_step = None if keep_through is None else keep_through + 1
        self._writer = SummaryWriter(log_dir=str(self.log_dir), purge_step=purge_step)
        if config_text is not None:
            self._writer.add_text("config", f"```toml\n{config_text}\n```", global_step=keep_through or 0)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        for name, value in _numbers(metrics).items():
            self._writer.add_scalar(name, float(value), global_step=int(step))  # stored as float32

    def log_table(self, step: int, name: str, rows: list[dict[str, Any]]) -> None:
        if rows:
            self._writer.add_text(name, markdown_table(rows), global_step=int(step))

    def close(self) -> None:
        self._writer.flush()
        self._writer.close()


def _netrc_has_wandb_key(environ: Mapping[str, str]) -> bool:
    """Whether the netrc file (NETRC, else ~/.netrc: where `wandb login` writes) has a password for the W&B host
    (WANDB_BASE_URL, else api.wandb.ai). Read with the standard library: wandb's own reader is internal API that
    moved between releases. An unreadable file counts as no key (the run then stays offline)."""
    path = Path(environ.get("NETRC") or Path.home() / ".netrc").expanduser()
    host = urlsplit(environ.get("WANDB_BASE_URL") or "https://api.wandb.ai").netloc
    try:
        creds = netrc.netrc(str(path)).authenticators(host)
    except (OSError, netrc.NetrcParseError):
        return False
    return bool(creds and creds[2])


def wandb_mode(environ: Mapping[str, str] | None = None) -> str:
    """The W&B mode of a run: WANDB_MODE when set (online, offline, disabled); else "online" when an API key is
    configured (WANDB_API_KEY, WANDB_IDENTITY_TOKEN_FILE, or a netrc entry for the W&B host); else "offline", so a
    run without an account (tests, CI, a laptop) never waits on the network or a login prompt."""
    environ = os.environ if environ is None else environ
    if environ.get("WANDB_MODE"):
        return environ["WANDB_MODE"]
    if environ.get("WANDB_API_KEY") or environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return "online"
    return "online" if _netrc_has_wandb_key(environ) else "offline"


# Quiet and cheap runs: no stdout/stderr capture (it would wrap the progress bar; the run's own log has the output),
# no code or requirements upload, no job artifact. A field this wandb release lacks is left out (the extra allows
# releases from 0.19, whose Settings differ in their x_ fields).
_WANDB_SETTINGS = {"console": "off", "save_code": False, "disable_job_creation": True, "x_save_requirements": False,
                   "quiet": True}


class WandbLogger:
    """One W&B run (wandb.init with `dir`: its files land in <dir>/wandb/<offline-run-...|run-...>), mode by
    `wandb_mode()`. Steps must increase within the run: one logger per phase."""

    def __init__(self, *, project: str, name: str, group: str | None, dir: str | os.PathLike,
                 config: dict[str, Any]) -> None:
        import wandb

        self._wandb = wandb
        self.dir = Path(dir)
        self.dir.mkdir(parents=True, exist_ok=True)  # made here: wandb releases differ on a missing `dir`
        fields = wandb.Settings.model_fields
        settings = wandb.Settings(**{k: v for k, v in _WANDB_SETTINGS.items() if k in fields})
        self.mode = wandb_mode()
        self.run = wandb.init(project=project, name=name, group=group, dir=str(self.dir), config=config,
                              mode=self.mode, settings=settings)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        values = _numbers(metrics)
        if values:
            self.run.log(values, step=int(step))

    def log_table(self, step: int, name: str, rows: list[dict[str, Any]]) -> None:
        if not rows:
            return
        cols = _columns(rows)
        # wandb.Table types each column and rejects a row that mixes types in one: a column whose values are all
        # numbers stays numeric (float), any other column becomes text; a missing value is None in either
        numeric = {c: all(isinstance(r.get(c), numbers.Real) or r.get(c) is None for r in rows) for c in cols}

        def cell(v: Any, c: str) -> Any:
            return None if v is None else float(v) if numeric[c] else str(v)

        data = [[cell(r.get(c), c) for c in cols] for r in rows]
        self.run.log({name: self._wandb.Table(columns=cols, data=data)}, step=int(step))

    def close(self) -> None:
        self.run.finish()


class MultiLogger:
    """Fans log / log_table / close out to `loggers` (tables only to those that show them)."""

    def __init__(self, loggers: Sequence[MetricsLogger]) -> None:
        self.loggers = list(loggers)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        for logger in self.loggers:
            logger.log(step, metrics)

    def log_table(self, step: int, name: str, rows: list[dict[str, Any]]) -> None:
        for logger in self.loggers:
            if isinstance(logger, TableLogger):
                logger.log_table(step, name, rows)

    def close(self) -> None:
        """Close every logger, even after one fails (an unclosed W&B run or event file loses its tail); the first
        error is raised afterwards, with the others noted on it."""
        errors: list[BaseException] = []
        for logger in self.loggers:
            try:
                logger.close()
            except Exception as e:  # re-raised below, once the other loggers are closed
                errors.append(e)
        if errors:
            for other in errors[1:]:
                errors[0].add_note(f"closing another logger also failed: {other!r}")
            raise errors[0]


def build_logger(logging_cfg: LoggingConfig, *, phase: str, phase_dir: Path, run_dir: Path, run_name: str,
                 config_text: str, config: dict[str, Any], enabled: bool, keep_through: int | None) -> MultiLogger:
    """The loggers of one phase ("sft", "rl"): <phase_dir>/metrics.jsonl always; <run_dir>/tensorboard/<phase>
    and a W&B run <run_name>-<phase> (group <run_name>) under <run_dir>/wandb when [logging] asks for them; the
    step profiler (trainer.profiling) when [logging] profile_steps does.
    `enabled` False (ranks other than 0): the disabled JSONL logger only, no writer or W&B run is created.
    `keep_through`: the step the phase starts after (0 fresh, the checkpoint's step on resume, None: keep all)."""
    # on every rank and before anything is opened: a missing package fails all ranks alike, none waits on rank 0
    check_backends(logging_cfg.backends)
    loggers: list[MetricsLogger] = [JSONLLogger(Path(phase_dir) / "metrics.jsonl", enabled=enabled,
                                                keep_through=keep_through)]
    if not enabled:
        return MultiLogger(loggers)
    name = logging_cfg.run_name or run_name
    try:
        if "tensorboard" in logging_cfg.backends:
            loggers.append(TensorBoardLogger(Path(run_dir) / "tensorboard" / phase, keep_through=keep_through,
                                             config_text=config_text))
        if "wandb" in logging_cfg.backends:
            loggers.append(WandbLogger(project=logging_cfg.project, name=f"{name}-{phase}", group=name, dir=run_dir,
                                       config=config))
    except BaseException:
        # wandb.init can fail (online without a network, a bad key): the ones already open are closed, not leaked
        with contextlib.suppress(Exception):
            MultiLogger(loggers).close()
        raise
    if logging_cfg.profile_steps:  # last: the other loggers' work for a step is inside its window, as the step's
        from trainer.profiling import StepProfiler

        loggers.append(StepProfiler(*logging_cfg.profile_steps, Path(phase_dir) / "profile",
                                    start_after=keep_through or 0))
    return MultiLogger(loggers)


def read_tensorboard_scalars(log_dir: str | os.PathLike) -> dict[str, list[tuple[int, float]]]:
    """Every scalar in the event files of `log_dir` (one phase's directory): {tag: [(step, value), ...]} in the
    order logged, read with TensorBoard's own EventAccumulator, so the events a resumed writer purged are gone, as
    in the UI. Values are float32 (what add_scalar stores)."""
    from tensorboard.backend.event_processing import event_accumulator as ea

    log_dir = Path(log_dir)
    if not any(log_dir.glob("events.out.tfevents.*")):
        raise FileNotFoundError(f"{log_dir}: no TensorBoard event files (events.out.tfevents.*) in this directory")
    # size_guidance 0: keep every event (the default keeps a reservoir sample of 10,000 per tag)
    acc = ea.EventAccumulator(str(log_dir), size_guidance={ea.SCALARS: 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}

