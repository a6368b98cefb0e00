"""The checks a rank would otherwise hit first, run once in the launcher (`megarl-train --check`
and every launch), so a bad input is one line and exit code 2 before any process starts.

    data      each split's prompt column exists and its first value is a prompt (tokenizer-free)
    model     the architecture is one megarl builds (megarl/models/spec.py)
    loggers   every trainer.logger backend's package is installed
    outputs   the generation dump directories can be written; TensorBoard's directory is not a file
    engine    engine_kwargs values vLLM takes unchecked and fails on once it sizes its cache
    sources   with the built-in scorers, every row's data source has a rule (not only the first row's)

The checks that tokenize the data and score a row live in megarl/launcher/preflight_data.py; the device
check in megarl/launcher/preflight.py.
"""
from __future__ import annotations

import importlib.util
import errno
import json
import os
import tempfile
import stat

from megarl.config.errors import ConfigError
from megarl.data.dataset import check_prompt
from megarl.engines.vllm import check_cpu as check_vllm_cpu
from megarl.models.spec import ModelSpec
from megarl.reward.rules import check_data_sources, rule_for
from megarl.storage.private_out import check_output_dir

LOGGER_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb"}


def check_architecture(hf_config: dict, where: str) -> None:
    try:
        ModelSpec.from_hf_config(hf_config)
    except ValueError as err:
        raise ConfigError(f"{where}: {err}", "actor_rollout_ref.model.path") from None


def check_score_head(path: str, key: str, instead: str) -> None:
    """A model read with its `score` head (the reward model, a critic with init_from=path) must have
    one with one label; the ranks would stop on it only after starting (reading the same config.json)."""
    with open(os.path.join(path, "config.json")) as f:
        hf = json.load(f)
    try:
        spec = ModelSpec.from_hf_config(hf)
    except ValueError as err:
        raise ConfigError(f"{path}: {err}", key) from None
    if spec.head != "score":
        raise ConfigError(f"{path} holds {spec.architecture}, which has no `score` head; give an HF "
                          f"*ForSequenceClassification checkpoint with one label{instead}", key)
    if spec.num_labels != 1:
        raise ConfigError(f"{path}: its score head has {spec.num_labels} labels; a scalar score needs 1", key)


def check_loggers(cfg) -> None:
    for name in cfg.trainer.logger:
        package = LOGGER_PACKAGES.get(name)
        if package and importlib.util.find_spec(package) is None:
            raise ConfigError(f"includes {name}, but the {package!r} package is not installed; pip install {package} "
                              "(or megarl[logging]), or remove it from the list", "trainer.logger")


def tokenizer_available(cfg) -> bool:
    """False while the model (and its tokenizer) is still to be bootstrapped."""
    path = cfg.model.tokenizer_path or cfg.model.path
    return bool(path) and os.path.isdir(path)


def check_columns(path: str, key: str, prompt_key: str) -> None:
    """The prompt column exists and its first value is a prompt (tokenizer-free, so it runs even
    while the model is still to be bootstrapped)."""
    ext = os.path.splitext(path)[1].lower()
    if ext == ".parquet":
        import pyarrow.parquet as pq  # optional dependency: only for .parquet files
        names = pq.read_schema(path).names
        first = None
        if prompt_key in names:
            table = pq.ParquetFile(path).read_row_group(0, columns=[prompt_key]) if pq.ParquetFile(
                path).num_row_groups else None
            try:
                first = table.slice(0, 1).to_pylist()[0] if table is not None and table.num_rows else None
            except UnicodeDecodeError:       # not UTF-8: the dataset names and skips that row (data/reading.py)
                first = None
    else:
        first = _first_json_row(path, ext)
        names = sorted(first) if isinstance(first, dict) else []
    if prompt_key not in names:
        raise ConfigError(f"{path} has no '{prompt_key}' column (it has: {', '.join(names) or 'none'}); set "
                          "data.prompt_key to the column holding the prompts (chat messages or text)", key)
    value = first.get(prompt_key) if isinstance(first, dict) else None
    problem = check_prompt(value, prompt_key) if value is not None else None
    if problem:
        raise ConfigError(f"{path}: first row: {problem}", key)


def _first_json_row(path: str, ext: str):
    with open(path, encoding="utf-8", errors="surrogateescape") as f:
        if ext == ".json":
            text = f.read()
            if text.lstrip().startswith("["):
                items = json.loads(text)
                return items[0] if items else None
            f.seek(0)
        for line in f:
            if line.strip():
                try:
                    return json.loads(line)
                except json.JSONDecodeError:
                    continue
    return None


# -- what the ranks would stop on only after the first step -------------------------------------------------
def check_output_paths(cfg) -> None:
    """Where the ranks write after they start: the generation dumps (after step 1) and TensorBoard's
    event directory. A dump directory that cannot be made or written, or a file where TensorBoard
    wants its directory, stops a run hours in; said here instead."""
    tr = cfg.trainer
    for key, path in (("trainer.rollout_data_dir", tr.rollout_data_dir),
                      ("trainer.validation_data_dir", tr.validation_data_dir)):
        if path and check_creatable_dir(path, key, "cannot create or write"):
            check_output_dir(path, key)      # the run directory's rule: others must not plant links there
    if "tensorboard" in tr.logger:
        board = os.path.join(tr.log_dir or tr.default_local_dir, "tensorboard")
        if os.path.lexists(board) and not os.path.isdir(board):
            raise ConfigError(f"{os.path.abspath(board)} is a file, and TensorBoard writes its event files into a "
                              "directory of that name; move the file away, set trainer.log_dir elsewhere, or remove "
                              "tensorboard from the list", "trainer.logger")
        if os.path.lexists(board):
            check_output_dir(board, "trainer.log_dir")


def check_creatable_dir(path: str, key: str, fail: str) -> bool:
    """Whether `path` exists as a directory this user can write; a missing one must be creatable: a
    directory made and removed at once in its nearest existing parent (access() says yes to root
    everywhere, /proc included). Nothing is left: --check creates nothing, and the run makes each
    directory (0700) where it first writes."""
    where = probe = os.path.abspath(path)
    while not os.path.lexists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        why = errno.EEXIST if probe == where else errno.ENOTDIR
    elif not os.access(probe, os.W_OK | os.X_OK):
        why = errno.EACCES
    elif probe == where:
        return True
    else:
        try:
            os.rmdir(tempfile.mkdtemp(prefix=".megarl-check-", dir=probe))
            return False
        except OSError as err:
            why = err.errno or errno.EACCES
    raise ConfigError(f"{fail} {where} ({os.strerror(why)}); choose a writable directory or remove the key", key)


# vLLM's EngineArgs fields that vLLM itself takes as given and fails on only once its engine sizes
# its cache (vllm 0.32.0, vllm/config/cache.py: `kv_cache_memory_bytes: int | None`, no bound).
VLLM_POSITIVE_INTS = ("kv_cache_memory_bytes",)


def check_engine_kwarg_values(cfg) -> None:
    ro = cfg.rollout
    if ro.name != "vllm":
        return
    given = (ro.engine_kwargs or {}).get("vllm") or {}
    for name in VLLM_POSITIVE_INTS:
        value = given.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
            raise ConfigError(f"is {value!r}; give a positive whole number of bytes per GPU, or remove it to size "
                              "the KV cache from gpu_memory_utilization",
                              f"actor_rollout_ref.rollout.engine_kwargs.vllm.{name}")


def check_vllm_on_cpu(cfg, has_gpu) -> None:
    """rollout.name=vllm where the trainer's device resolves to cpu (`has_gpu()` decides auto): the
    CPU backend's limits (megarl/engines/vllm.py check_cpu), the model's head size where its
    config.json already exists (a bootstrapped model is checked where the engine is built)."""
    device = cfg.trainer.device
    if cfg.rollout.name != "vllm" or device == "cuda" or (device == "auto" and has_gpu()):
        return
    config_json = os.path.join(cfg.model.path or "", "config.json")
    hf_config = {}
    if os.path.isfile(config_json):
        with open(config_json) as f:
            hf_config = json.load(f)
    check_vllm_cpu(cfg.rollout, hf_config)


def check_data_sources_scored(cfg) -> None:
    """With the built-in scorers, every distinct data source of every row has a rule: --check scores one
    row, and a source first seen at step 40 would stop the run there. Reads only that column."""
    rm, crf = cfg.reward_model, cfg.custom_reward_function
    if rm.enable or rm.reward_manager != "naive" or crf.path or (cfg.data.custom_cls or {}).get("path"):
        return                                   # the user's scorer or dataset: it knows its sources
    column = cfg.data.reward_fn_key
    for split, files in (("train", cfg.data.train_files), ("val", cfg.data.val_files)):
        for path in files:
            for source, where in _first_of_each(path, column).items():
                if rule_for(source) is None:
                    try:
                        check_data_sources([source], "data.reward_fn_key")
                    except ValueError as err:
                        raise ConfigError(f"{path}: {where}: {err}", f"data.{split}_files") from None


def _first_of_each(path: str, column: str) -> dict:
    """Each distinct value of `column` in a data file, with where it first appears ("row 7")."""
    found: dict = {}
    if path.lower().endswith(".parquet"):
        import pyarrow.parquet as pq  # optional dependency: only for .parquet files
        if column not in pq.read_schema(path).names:
            return {None: "row 1"}
        cells = pq.read_table(path, columns=[column]).column(column)
        try:
            values = cells.to_pylist()
        except UnicodeDecodeError:           # not UTF-8: the dataset names and skips such rows
            values = [_utf8_or_skip(cell) for cell in cells]
        for number, value in enumerate(values, 1):
            if value is not _SKIP:
                found.setdefault(_hashable(value), f"row {number}")
        return found
    with open(path, encoding="utf-8", errors="surrogateescape") as f:
        text = f.read()
    if text.lstrip().startswith("["):
        items = json.loads(text)
        rows = [(f"item {i}", r) for i, r in enumerate(items if isinstance(items, list) else [items], 1)]
    else:
        rows = []
        for number, line in enumerate(text.splitlines(), 1):
            try:
                rows.append((f"line {number}", json.loads(line)))
            except ValueError:              # the dataset names and skips such lines
                continue
    for where, row in rows:
        if isinstance(row, dict):
            found.setdefault(_hashable(row.get(column)), where)
    return found


_SKIP = object()


def _utf8_or_skip(cell):
    try:
        return cell.as_py()
    except UnicodeDecodeError:
        return _SKIP


def _hashable(value):
    return value if isinstance(value, (str, int, float, bool, type(None))) else json.dumps(value, default=str)


def tighten_run_dir(path: str) -> str | None:
    """A run directory made beforehand with the shell's umask (0755) lets others read the run's
    config, logs and dumps: it is made 0700, and the line saying so is returned. One that others
    can write is refused before this where megarl-train checks (preflight.check_run_dir_private)."""
    try:
        mode = stat.S_IMODE(os.stat(path).st_mode)
    except FileNotFoundError:
        return None
    if not mode & 0o077:
        return None
    os.chmod(path, 0o700)
    what = "writable" if mode & 0o022 else "readable"     # writable: a launch whose launcher did not check
    return (f"megarl: {os.path.abspath(path)} was {what} by other users (mode {mode:o}); made it 0700, as megarl "
            "keeps a run's files to its user")
