"""Everything that can be checked before a process is spawned, a model bootstrapped or loaded.

    megarl-train runs `preflight(cfg)` right after the config loads; a problem is one
    `megarl: config error: <key>: <what>; <fix>` line and exit code 2, with no rank started.

What it checks, model first, reading no model weights:
- the model path is a checkpoint of a supported architecture, or the absent path its own config's
  bootstrap builds (megarl/config/model_path.py); prompt + response fit its positions; its
  safetensors headers add up and its vocabulary tensors match config.json (preflight_weights.py);
- data files exist, are readable UTF-8 / parquet files with the prompt column;
- the rollout engine is known and importable; a custom class, the tools file and the
  interactions load (an interaction class is built with its config); the device
  and logger packages asked for are here (megarl/launcher/preflight_run.py);
- the reward function (or manager) imports and has the right signature;
- with the tokenizer at hand: each split tokenized as the ranks do it, usable rows vs the batch
  size, the reward on one real row (a bootstrapped model: right after the launcher builds it);
- model.external_lib imports; the run directory is writable and has room for a checkpoint.
The layout is checked by the config itself (ExperimentConfig) and against the model here.
"""
from __future__ import annotations

import importlib
import importlib.util
import json
import os
import stat

from megarl.algos.config import check_bypass_mode
from megarl.config.errors import ConfigError
from megarl.config.model_path import model_path_state
from megarl.config.plugins import get_attr, import_external_libs, import_path, load_class, load_object
from megarl.launcher.diskspace import check_free_space
from megarl.storage.durable import make_private_dir
from megarl.engines import EngineInfo, default_name, resolve
from megarl.launcher.preflight_run import (check_architecture, check_columns, check_loggers, check_score_head,
                                           tokenizer_available)
from megarl.launcher.preflight_run import (check_creatable_dir, check_data_sources_scored, check_engine_kwarg_values,
                                           check_output_paths, check_vllm_on_cpu)
from megarl.launcher.preflight_weights import check_tokenizer_size, check_vocab_size
from megarl.reward.loading import RewardFnSpec, load_reward_fn
from megarl.rollout.config import check_engine_asks
from megarl.rollout.config_checks import check_engine_overrides

_RO = "actor_rollout_ref.rollout"


def preflight(cfg, not_checked: list[str] | None = None) -> None:
    """Raise ConfigError (one line) for the first problem found; return quietly otherwise.
    `not_checked` (--check): what needs the nodes' GPUs or their engine package, on a machine
    without a GPU (a login node), is listed there, one line each, and the other checks go on."""
    import_external_libs(cfg)
    check_model_paths(cfg)                     # first: a missing model is the first thing to fix
    check_data(cfg)
    check_device(cfg, check_engine(cfg, not_checked), not_checked)
    check_vllm_on_cpu(cfg, _has_gpu)
    check_loggers(cfg)
    check_engine_kwarg_values(cfg)
    check_reward(cfg)
    check_data_sources_scored(cfg)
    if tokenizer_available(cfg):               # else after the bootstrap: bootstrap_and_check()
        check_with_tokenizer(cfg)
    check_run_dir(cfg.trainer.default_local_dir, "trainer.default_local_dir")
    check_run_dir_private(cfg.trainer.default_local_dir, "trainer.default_local_dir")
    check_free_space(cfg)     # a full disk passes the write check (an empty file needs no blocks)
    if cfg.trainer.log_dir:
        check_run_dir(cfg.trainer.log_dir, "trainer.log_dir")
    check_output_paths(cfg)


def node_checks(cfg) -> None:
    """What is a node's own, for the nodes after the first and for ranks whose launcher ran
    preflight(): its devices and its run directory. The inputs (data, model, reward) are checked
    once per job, not once per rank: tokenising every split took 3.3 s a rank for the quickstart."""
    import_external_libs(cfg)
    check_device(cfg, resolve(cfg.rollout.name))
    check_run_dir(cfg.trainer.default_local_dir, "trainer.default_local_dir")
    check_free_space(cfg)


def check_with_tokenizer(cfg) -> None:
    """The data as the ranks tokenize it, and the reward on one real row."""
    from megarl.launcher.preflight_data import (check_datasets, check_model_overrides,  # torch
                                                check_reward_on_a_row, load_tokenizer)
    check_model_overrides(cfg)
    tokenizer = load_tokenizer(cfg)
    check_tokenizer_size(len(tokenizer), cfg.model.path, cfg.model.tokenizer_path or cfg.model.path)
    train = check_datasets(cfg, tokenizer)
    check_reward_on_a_row(cfg, train)


def bootstrap_and_check(cfg) -> None:
    """Build a bootstrapped model here, in the launcher, so the checks that need its tokenizer run
    before any rank starts (the ranks then find the model in place)."""
    m = cfg.model
    if model_path_state(m.path, m.bootstrap) != "bootstrap":
        return
    make_private_dir(os.path.dirname(os.path.abspath(m.path)))    # checked creatable, made by the run only
    load_object(m.bootstrap, "actor_rollout_ref.model.bootstrap")(m.path, cfg, **m.bootstrap_kwargs)
    if model_path_state(m.path, None) != "ready":
        raise ConfigError(f"{m.path} still holds no config.json after the bootstrap",
                          "actor_rollout_ref.model.bootstrap")
    check_with_tokenizer(cfg)


# -- data ----------------------------------------------------------------------------------------------
def check_data(cfg) -> None:
    for split, files in (("train", cfg.data.train_files), ("val", cfg.data.val_files)):
        key = f"data.{split}_files"
        if split == "train" and not files:
            raise ConfigError("no training data; set data.train_files=<file.jsonl|.json|.parquet>", key)
        for path in files:
            rows = count_rows(path, key)
            if rows == 0:
                raise ConfigError(f"{path} holds no rows; give a file with prompts", key)
            if not (cfg.data.custom_cls or {}).get("path"):   # a custom dataset class reads its own columns
                check_columns(path, key, cfg.data.prompt_key)


def count_rows(path: str, key: str) -> int:
    """Rows in a data file, reading only what is needed to know that it parses and is not empty."""
    if os.path.isdir(path):
        inside = sorted(f for f in os.listdir(path) if os.path.splitext(f)[1] in (".parquet", ".jsonl", ".json"))
        raise ConfigError(f"{path} is a directory; give the data file itself"
                          + (f", e.g. {os.path.join(path, inside[0])}" if inside else ""), key)
    if not os.path.isfile(path):
        hint = " (relative paths in a config file are taken from that file's folder)" if not os.path.isabs(path) else ""
        raise ConfigError(f"data file not found: {path}{hint}", key)
    try:
        with open(path, "rb") as f:
            bom = f.read(2) in (b"\xff\xfe", b"\xfe\xff")
        if bom:
            raise ConfigError(f"{path} is not UTF-8 text (it starts with a UTF-16 byte-order mark); save it as UTF-8 "
                              "(e.g. iconv -f UTF-16 -t UTF-8)", key)
        # Other bytes that are not UTF-8 are the rows' problem: the dataset names and skips each such row.
        return _count_rows(path, key)
    except OSError as err:
        raise ConfigError(f"cannot read {path} ({err.strerror or type(err).__name__}); check its permissions",
                          key) from None


def _count_rows(path: str, key: str) -> int:
    ext = os.path.splitext(path)[1].lower()
    if ext == ".parquet":
        try:
            import pyarrow.parquet as pq  # optional at run time: only for .parquet files
            return pq.ParquetFile(path).metadata.num_rows
        except Exception as err:
            raise ConfigError(f"{path}: not a readable parquet file ({type(err).__name__}: {err})", key) from None
    if ext not in (".jsonl", ".json"):
        raise ConfigError(f"{path}: unsupported file type {ext or '(none)'}; use .jsonl, .json or .parquet", key)
    with open(path, encoding="utf-8", errors="surrogateescape") as f:
        head = f.read(1 << 16)
        if ext == ".json" and head.lstrip().startswith("["):
            try:
                items = json.loads(head + f.read())
            except json.JSONDecodeError as err:
                raise ConfigError(f"{path}: not valid JSON (line {err.lineno}: {err.msg})", key) from None
            return len(items) if isinstance(items, list) else 1
        f.seek(0)
        rows = good = 0
        for line in f:  # malformed lines are the dataset's business (counted, with a threshold)
            if line.strip():
                rows += 1
                if good == 0:
                    try:
                        json.loads(line)
                        good = 1
                    except json.JSONDecodeError:
                        pass
                elif rows > 1000:  # parsed one good row and counted enough to know it is not empty
                    break
        if rows and not good:
            raise ConfigError(f"{path}: no line of the first {rows} is valid JSON; give one JSON object per line", key)
        return rows


# -- model -----------------------------------------------------------------------------------------------
def read_json(path: str, key: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as err:        # ValueError: bad JSON or not UTF-8
        raise ConfigError(f"{path}: cannot read ({type(err).__name__}: {err})", key) from None


def check_model_paths(cfg) -> None:
    m, key = cfg.model, "actor_rollout_ref.model.path"
    if not m.path:
        raise ConfigError("no model: set it to an HF checkpoint directory (config.json + *.safetensors), or set "
                          "actor_rollout_ref.model.bootstrap to a function that creates one", key)
    config_json = os.path.join(m.path, "config.json")
    if model_path_state(m.path, m.bootstrap) == "bootstrap":
        check_import_path(m.bootstrap, "actor_rollout_ref.model.bootstrap")
        check_run_dir(os.path.dirname(os.path.abspath(m.path)), key)
    else:
        hf = read_json(config_json, key)
        check_architecture(hf, config_json)    # before the layout: GPT-2's n_head is not num_attention_heads
        cfg.check_model(hf)   # layout against heads/layers; lengths against positions
        check_weight_format(m.path, key)
        check_vocab_size(hf, m.path, key)   # headers only; a shape error from every rank otherwise
    bootstrapping = not os.path.isfile(config_json)  # the bootstrap may write the tokenizer too
    if m.tokenizer_path and m.tokenizer_path != m.path and not bootstrapping and not os.path.exists(m.tokenizer_path):
        raise ConfigError(f"{m.tokenizer_path} does not exist; point it at a tokenizer directory or remove it "
                          "(the model's own is used)", "actor_rollout_ref.model.tokenizer_path")
    crit = cfg.critic
    if (crit.enable and crit.model.init_from == "path"
            and not os.path.isfile(os.path.join(crit.model.path or "", "config.json"))):
        raise ConfigError(f"{crit.model.path} holds no config.json; critic.model.init_from=path needs an HF "
                          "checkpoint (or use init_from=actor)", "critic.model.path")
    if crit.enable and crit.model.init_from == "path":
        check_score_head(crit.model.path, "critic.model.path", ", or set critic.model.init_from=actor (the actor's "
                                                               "backbone with a new value head)")
    if cfg.reward_model.enable:
        rm_path = (cfg.reward_model.model or {}).get("path")
        if not rm_path or not os.path.isfile(os.path.join(rm_path, "config.json")):
            raise ConfigError(f"{rm_path} holds no config.json; reward_model.enable=true needs reward_model.model.path "
                              "set to an HF checkpoint with a score head", "reward_model.model.path")
        check_score_head(rm_path, "reward_model.model.path", " (a reward model, e.g. verl's "
                                                             "FsfairX-LLaMA3-RM-v0.1)")
    if cfg.trainer.resume_mode == "resume_path" and not os.path.isdir(cfg.trainer.resume_from_path):
        raise ConfigError(f"{cfg.trainer.resume_from_path} is not a directory; give a global_step_N directory",
                          "trainer.resume_from_path")


def check_weight_format(path: str, key: str) -> None:
    """Weights only as pickles (pytorch_model*.bin), or none at all: megarl reads safetensors only and
    never unpickles a model file, so the ranks would refuse it after start-up; said here, with the fix."""
    names = os.listdir(path)
    if any(n.endswith(".safetensors") or n == "model.safetensors.index.json" for n in names):
        for name in sorted(n for n in names if n.endswith(".safetensors")):
            problem = safetensors_problem(os.path.join(path, name))
            if problem:
                raise ConfigError(f"{os.path.join(path, name)} {problem}; re-save or re-download the model", key)
        return
    pickles = sorted(n for n in names if n.endswith((".bin", ".pt", ".pth", ".ckpt")))
    if pickles:
        raise ConfigError(f"{path} holds its weights only as {pickles[0]}, a pickle megarl does not load (loading one "
                          "can run code); convert it once where you trust the file: AutoModelForCausalLM."
                          "from_pretrained(path).save_pretrained(path, safe_serialization=True)", key)
    raise ConfigError(f"{path} holds config.json but no weights (no *.safetensors file); the ranks would stop on it "
                      "after start-up: download the whole checkpoint there (`hf download <repo id> --local-dir "
                      f"{path}`) or point the key at a directory with config.json and *.safetensors", key)


_DTYPE_BYTES = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2, "U16": 2,
                "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


def safetensors_problem(path: str) -> str | None:
    """What is wrong with a safetensors file's header (its JSON only: no tensor is read): a file that
    is no safetensors file (a link to /etc/shadow), or tensors whose sizes and offsets do not add up
    to the file (a header that lies). None when it checks out."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(8)
        length = int.from_bytes(head, "little") if len(head) == 8 else -1
        if length < 2 or length > min(size - 8, 100 << 20):
            return "is not a safetensors file (no header of a valid length)"
        try:
            header = json.loads(f.read(length))
            end = 0
            for name, info in header.items():
                if name == "__metadata__":
                    continue
                start, stop = info["data_offsets"]
                count = 1
                for dim in info["shape"]:
                    count *= int(dim)
                width = _DTYPE_BYTES.get(info["dtype"])
                if width is not None and stop - start != count * width:
                    return (f"says tensor {name} of shape {info['shape']} ({info['dtype']}) takes {stop - start} "
                            f"bytes, not {count * width}")
                end = max(end, stop)
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            return f"is not a safetensors file (its header: {type(err).__name__})"
    if 8 + length + end != size:
        return f"has {size} bytes, but its header accounts for {8 + length + end}"
    return None


def check_device(cfg, info: EngineInfo, not_checked: list[str] | None = None) -> None:
    """The trainer's device and the engine's declared devices, against this machine (with
    `not_checked`, a machine without a GPU is a login node: listed there, not refused)."""
    device, name = cfg.trainer.device, cfg.rollout.name
    if device == "cpu" and "cpu" in info.devices:
        return
    if device == "cuda" and "cuda" not in info.devices:
        raise ConfigError(f"cuda, but the {name} engine runs on {', '.join(info.devices)} only in megarl; set "
                          f"trainer.device={info.devices[0]} or use rollout.name={default_name()}", "trainer.device")
    import torch  # lazy: the launcher loads torch only when a GPU is asked for
    if torch.cuda.is_available():
        return
    if not_checked is not None and (device == "cuda" or "cpu" not in info.devices):
        not_checked.append(f"the GPU: this machine has none (torch.cuda.is_available() is false); trainer.device="
                           f"{device} with rollout.name={name} is checked on the nodes when the job starts")
        return
    if device == "cuda":
        raise ConfigError("cuda, but this machine has no usable GPU (torch.cuda.is_available() is false); "
                          "set trainer.device=cpu (or auto) to train on CPU over gloo", "trainer.device")
    if "cpu" not in info.devices:
        raise ConfigError(f"{name} runs on NVIDIA GPUs only and this machine has none; use rollout.name="
                          f"{default_name()}", "actor_rollout_ref.rollout.name")


# -- engine, reward, user imports ----------------------------------------------------------------------
def check_engine(cfg, not_checked: list[str] | None = None) -> EngineInfo:
    """The engine is declared, integrated and importable; its abilities (a user's class: what the
    class declares) against what the config asks of it. With `not_checked`, a GPU-only engine's
    package missing on a machine without a GPU (a login node) is listed there, not refused."""
    ro, key = cfg.rollout, f"{_RO}.name"
    info = resolve(ro.name)
    missing = info.requires and importlib.util.find_spec(info.requires) is None
    if missing and not_checked is not None and "cpu" not in info.devices and not _has_gpu():
        not_checked.append(f"rollout.name={ro.name}: its {info.requires!r} package is not installed on this machine "
                           "(no GPU either); it is imported on the nodes when the job starts")
        check_multiturn(cfg)
        return info
    if missing:
        raise ConfigError(f"rollout.name={ro.name} needs the {info.requires!r} package, which is not installed "
                          f"here; install it or use rollout.name={default_name()}", key)
    if info.user_class:
        from megarl.rollout.registry import abilities  # lazy: loads torch and the user's class
        info = abilities(ro)
        check_engine_asks(ro, info, _RO)
        check_bypass_mode(cfg, info)
        check_engine_overrides(cfg, info)
    check_multiturn(cfg)
    return info


def _has_gpu() -> bool:
    import torch  # lazy, as in check_device
    return torch.cuda.is_available()


def check_multiturn(cfg) -> None:
    """What build_agent_loop loads on every rank: the tools file with its implementations, and each
    interaction (a class is built with its config, as the ranks build it)."""
    mt = cfg.rollout.multi_turn
    if not mt.enable:
        return
    from megarl.rollout.multiturn.interactions import load_interactions  # lazy: loads torch (launcher avoids it)
    from megarl.rollout.multiturn.tools import load_tools  # lazy: loads torch, which the launcher avoids
    if mt.tool_config_path:
        load_tools(mt.tool_config_path)
    load_interactions(list(cfg.rollout.interactions), mt.interaction_config_path)


def check_reward(cfg) -> None:
    kind = cfg.reward_model.reward_manager
    crf = cfg.custom_reward_function
    if kind in ("naive", "batch"):
        load_reward_fn(crf, batched=kind == "batch")
    else:
        load_class(kind, "reward_model.reward_manager", ("naive", "batch"))
        RewardFnSpec(crf.path, crf.name, dict(crf.reward_kwargs)).load()


def check_import_path(ref: str, key: str) -> None:
    """`pkg.module:function` or `file.py:function` resolves to something callable."""
    if ":" not in ref:
        raise ConfigError(f"{ref!r} is not an import path; write 'pkg.module:function' or 'file.py:function'", key)
    path, name = ref.rsplit(":", 1)
    if not callable(get_attr(import_path(path, key), name, key, "function")):
        raise ConfigError(f"{ref} is not callable", key)


# -- outputs --------------------------------------------------------------------------------------------
def check_run_dir(path: str, key: str) -> None:
    """`path` can be written, or created: the run makes it (0700) when it starts, --check makes nothing."""
    check_creatable_dir(path, key, "cannot write to")


def check_run_dir_private(path: str, key: str) -> None:
    """Every resume refuses a run directory that another user could write (megarl/trainer/checkpoints/verified_io.py):
    refused here, before a run trains and saves into one it could never resume from."""
    if not os.path.exists(path):
        return                    # the run makes it, this user's and 0700
    st = os.stat(path)
    mode = stat.S_IMODE(st.st_mode)
    if st.st_uid != os.geteuid():
        raise ConfigError(f"{os.path.abspath(path)} is owned by uid {st.st_uid}, not by this user; its checkpoints "
                          "could not be resumed from; choose a directory of your own", key)
    if mode & 0o022:
        raise ConfigError(f"{os.path.abspath(path)} is writable by {'group' if mode & 0o020 else 'others'} (mode "
                          f"{mode:o}), so no resume would trust its checkpoints; chmod 700 {os.path.abspath(path)} "
                          "(or choose a new directory)", key)
