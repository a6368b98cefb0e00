"""A conformance fake of vLLM's CUDA build: what megarl's adapter (megarl/rollout/vllm/) calls
there that cannot run here (no GPU; vLLM's CUDA wheel does not install on this machine).

FAKE. Built from vLLM's source, each rule from the file named beside it (vllm-project/vllm;
docs/rollout.md repeats them):
  LLM(**kw)                 EngineArgs' fields (tests/assets/vllm/engine_args-99d7eb5.json), plus
                            weight_transfer_config where the build has the API (arg_utils.py, index
                            excerpt without a commit: `WeightTransferConfig | None`, a dict accepted);
                            any other keyword is the dataclass's own TypeError
  the worker's session      v1/worker/gpu_worker.py (index excerpt without a commit):
                            "Weight transfer not configured" without a config; start while active,
                            update or finish without start refused; a failed update ends the session
  engines and factory       weight_transfer/base.py @ 02f250b0 (parse_*_info: TypeError -> ValueError;
                            update_weights = parse, receive_weights, synchronize);
                            weight_transfer/factory.py @ 047c993c (nccl, ipc, sparse_nccl registered;
                            a name registered twice or an unknown backend: ValueError)
  sleep / wake_up           v1/worker/gpu_worker.py @ 35d5cda1: level 1 offloads the "weights" pool
                            to the host, level 2 offloads nothing (weights discarded, named buffers
                            kept on the host and put back on wake_up); the KV cache is dropped at
                            both; wake_up(tags) maps the tagged pools back (None: all)
What the fake adds, as CUDA would have it: a write to weights that sleep unmapped is refused (on a
GPU an illegal memory access), and weights discarded at level 2 come back as garbage (NaN here).
The model: vLLM's view of the checkpoint's tensors by HF name; load_weights refuses an unknown name
(vLLM's params_dict lookup, a KeyError) and a wrong shape (default_weight_loader's assert).
Generation is not faked: the tests here hold the sync and sleep rules; generate() is refused while
anything is asleep, mid-update, or garbage, else returns the fake's weight checksum per prompt.
"""
from __future__ import annotations

import dataclasses
import json
import sys
import types
from pathlib import Path
from typing import Any

import torch

ASSET = Path(__file__).resolve().parents[1] / "assets" / "vllm" / "engine_args-99d7eb5.json"
TAGS = ("weights", "kv_cache")
WAKE_TAGS = TAGS + ("scheduling",)       # wake_up's tags (vllm 0.32.0 v1/engine/core.py, test_vllm_args._LLM)


class FakeModel:
    """The checkpoint's tensors by HF name, as vLLM's model loads them."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], owner: "FakeWorker"):
        self.params = {n: torch.zeros(s) for n, s in shapes.items()}
        self.owner, self.reloading, self.loaded = owner, False, []

    def load_weights(self, weights):
        if self.owner.pools["weights"] != "mapped":
            raise RuntimeError("CUDA error: an illegal memory access was encountered (weights written while "
                               "vLLM's sleep mode had them unmapped)")
        touched = set()
        for name, t in weights:
            param = self.params[name]                  # KeyError for a name the model lacks, as vLLM's
            assert param.shape == t.shape, f"{name}: {tuple(param.shape)} vs {tuple(t.shape)}"
            param.copy_(t)
            touched.add(name)
            self.loaded.append(name)
        return touched


def _reload_module():
    mod = types.ModuleType("vllm.model_executor.model_loader.reload")

    def initialize_layerwise_reload(model):
        model.reloading = True

    def finalize_layerwise_reload(model, model_config):
        model.reloading = False

    mod.initialize_layerwise_reload = initialize_layerwise_reload
    mod.finalize_layerwise_reload = finalize_layerwise_reload
    return mod


def _transfer_modules():
    """vllm.distributed.weight_transfer.base and .factory, as read (module docstring)."""
    base = types.ModuleType("vllm.distributed.weight_transfer.base")

    @dataclasses.dataclass
    class WeightTransferInitInfo:
        pass

    @dataclasses.dataclass
    class WeightTransferUpdateInfo:
        pass

    class WeightTransferEngine:
        init_info_cls: type
        update_info_cls: type

        def __init__(self, config, vllm_config, device, model):
            self.config, self.vllm_config, self.device, self.model = config, vllm_config, device, model
            self.parallel_config, self.model_config = vllm_config.parallel_config, vllm_config.model_config

        def parse_init_info(self, init_dict):
            try:
                return self.init_info_cls(**init_dict)
            except TypeError as e:
                raise ValueError(f"Invalid init_info for {self.__class__.__name__}: {e}") from e

        def parse_update_info(self, update_dict):
            try:
                return self.update_info_cls(**update_dict)
            except TypeError as e:
                raise ValueError(f"Invalid update_info for {self.__class__.__name__}: {e}") from e

        def start_weight_update(self):
            raise NotImplementedError

        def finish_weight_update(self):
            raise NotImplementedError

        def update_weights(self, update_info):
            self.receive_weights(self.parse_update_info(update_info))

    base.WeightTransferEngine, base.WeightTransferInitInfo = WeightTransferEngine, WeightTransferInitInfo
    base.WeightTransferUpdateInfo = WeightTransferUpdateInfo

    factory = types.ModuleType("vllm.distributed.weight_transfer.factory")

    class WeightTransferEngineFactory:
        _registry: dict = {}

        @classmethod
        def register_engine(cls, name, module_path_or_cls, class_name=None):
            if name in cls._registry:
                raise ValueError(f"Weight transfer engine '{name}' is already registered.")
            if isinstance(module_path_or_cls, str):
                def loader():
                    raise RuntimeError(f"the fake has no {class_name}: vLLM's {name} engine moves CUDA memory")
                cls._registry[name] = loader
            else:
                cls._registry[name] = lambda: module_path_or_cls

        @classmethod
        def create_engine(cls, config, vllm_config, device, model):
            if config.backend not in cls._registry:
                raise ValueError(f"Invalid weight transfer backend: {config.backend}. Available engines: "
                                 f"{list(cls._registry)}")
            return cls._registry[config.backend]()(config, vllm_config, device, model)

    for name, cls_name in (("nccl", "NCCLWeightTransferEngine"), ("ipc", "IPCWeightTransferEngine"),
                           ("sparse_nccl", "SparseNCCLWeightTransferEngine")):
        WeightTransferEngineFactory.register_engine(name, f"vllm.distributed.weight_transfer.{name}_engine", cls_name)
    factory.WeightTransferEngineFactory = WeightTransferEngineFactory
    return base, factory


class FakeWorker:
    """gpu_worker.Worker's weight-transfer session and sleep (module docstring)."""

    def __init__(self, llm: "LLM", shapes, transfer_config, factory):
        self.llm = llm
        self.pools = {"weights": "mapped", "kv_cache": "mapped"}
        self.model = FakeModel(shapes, self)
        self._sleep_saved_buffers: dict = {}
        # GPUModelRunner keeps its torch.device (vllm/v1/worker/gpu_model_runner.py: self.device)
        self.model_runner = types.SimpleNamespace(get_model=lambda: self.model, model_config=None,
                                                  device=torch.device("cuda", 0),
                                                  sampler=types.SimpleNamespace(topk_topp_sampler=types.SimpleNamespace()))
        vllm_config = types.SimpleNamespace(parallel_config=types.SimpleNamespace(rank=0), model_config=None)
        self.weight_transfer_engine = None
        if transfer_config is not None:
            config = types.SimpleNamespace(**transfer_config)
            self.weight_transfer_engine = factory.create_engine(config, vllm_config, torch.device("cuda"), self.model)
        self._weight_update_active = False

    def _check_weight_transfer_engine(self):
        if self.weight_transfer_engine is None:
            raise RuntimeError("Weight transfer not configured. Please set weight_transfer_config to enable "
                               "weight transfer.")

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self._check_weight_transfer_engine()
        engine = self.weight_transfer_engine
        engine.init_transfer_engine(engine.parse_init_info(init_info))

    def start_weight_update(self) -> None:
        self._check_weight_transfer_engine()
        if self._weight_update_active:
            raise RuntimeError("start_weight_update called while a weight update is already active. Call "
                               "finish_weight_update first.")
        self.weight_transfer_engine.start_weight_update()
        self._weight_update_active = True

    def update_weights(self, update_info: dict) -> None:
        self._check_weight_transfer_engine()
        if not self._weight_update_active:
            raise RuntimeError("start_weight_update must be called before update_weights.")
        try:
            self.weight_transfer_engine.update_weights(update_info)
        except BaseException:
            self._weight_update_active = False
            raise

    def finish_weight_update(self) -> None:
        self._check_weight_transfer_engine()
        if not self._weight_update_active:
            raise RuntimeError("finish_weight_update called without a matching start_weight_update.")
        self.weight_transfer_engine.finish_weight_update()
        self._weight_update_active = False

    def sleep(self, level: int = 1) -> None:
        self.pools["weights"] = "host" if level == 1 else "discarded"
        self.pools["kv_cache"] = "discarded"

    def wake_up(self, tags: list[str] | None = None) -> None:
        for tag in [t for t in (tags if tags is not None else TAGS) if t in TAGS]:
            if self.pools[tag] == "discarded" and tag == "weights":
                for p in self.model.params.values():
                    p.fill_(float("nan"))              # unmapped memory comes back with no content
            self.pools[tag] = "mapped"


class LLM:
    """vllm.LLM, in-process (the engine core in the caller's process, as megarl runs it)."""
    transfer_api = True
    shapes: dict = {}
    built: list = []

    def __init__(self, **kw):
        fields = engine_args_fields(self.transfer_api)
        unknown = sorted(set(kw) - set(fields))
        if unknown:
            raise TypeError(f"EngineArgs.__init__() got an unexpected keyword argument {unknown[0]!r}")
        self.kw, self.calls = kw, []
        self.enable_sleep_mode = bool(kw.get("enable_sleep_mode"))
        self.worker = FakeWorker(self, self.shapes, kw.get("weight_transfer_config"),
                                 sys.modules["vllm.distributed.weight_transfer.factory"].WeightTransferEngineFactory
                                 if self.transfer_api else None)
        finalizer = types.SimpleNamespace(detach=lambda: None)
        self.llm_engine = types.SimpleNamespace(engine_core=types.SimpleNamespace(_finalizer=finalizer))
        LLM.built.append(self)

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        name = method if isinstance(method, str) else method.__name__
        self.calls.append(name)
        fn = getattr(self.worker, method) if isinstance(method, str) else (lambda *a, **k: method(self.worker, *a, **k))
        return [fn(*args, **(kwargs or {}))]

    def sleep(self, level: int = 1) -> None:
        if not self.enable_sleep_mode:
            raise ValueError("Sleep mode is not enabled (enable_sleep_mode=False)")
        if level not in (1, 2):
            raise ValueError(f"sleep level {level}: vLLM's levels are 1 and 2")
        self.calls.append(f"sleep{level}")
        self.worker.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        if tags is not None and not set(tags) <= set(WAKE_TAGS):
            raise ValueError(f"wake_up tags {tags}: vLLM's are {list(WAKE_TAGS)}")
        self.calls.append(f"wake_up:{','.join(tags) if tags else 'all'}")
        self.worker.wake_up(tags)

    def reset_prefix_cache(self) -> bool:
        self.calls.append("reset_prefix_cache")
        return True

    def generate(self, prompts, params, use_tqdm=False):
        w = self.worker
        if w.pools != {"weights": "mapped", "kv_cache": "mapped"} or w._weight_update_active or w.model.reloading:
            raise RuntimeError(f"generate with pools {w.pools}, update active {w._weight_update_active}")
        total = sum(float(p.sum()) for p in w.model.params.values())
        if total != total:
            raise RuntimeError("generate on garbage weights (discarded at sleep level 2, never rewritten)")
        return [total for _ in prompts]


def engine_args_fields(transfer_api: bool) -> list[str]:
    fields = list(json.loads(ASSET.read_text())["engine_args_fields"])
    return fields + ["weight_transfer_config"] if transfer_api else fields


def modules(shapes: dict, transfer_api: bool = True) -> dict[str, Any]:
    """sys.modules entries for `import vllm` and what megarl's adapter imports from it."""
    cls = type("LLM", (LLM,), {"transfer_api": transfer_api, "shapes": shapes, "built": []})
    vllm = types.ModuleType("vllm")
    vllm.LLM = cls
    arg_utils = types.ModuleType("vllm.engine.arg_utils")
    arg_utils.EngineArgs = dataclasses.make_dataclass(
        "EngineArgs", [(f, Any, dataclasses.field(default=None)) for f in engine_args_fields(transfer_api)])
    parallel_state = types.ModuleType("vllm.distributed.parallel_state")
    parallel_state.get_tp_group = lambda: types.SimpleNamespace(ranks=[0])
    distributed = types.ModuleType("vllm.distributed")
    distributed.parallel_state = parallel_state
    out = {"vllm": vllm, "vllm.engine": types.ModuleType("vllm.engine"), "vllm.engine.arg_utils": arg_utils,
           "vllm.distributed": distributed, "vllm.distributed.parallel_state": parallel_state,
           "vllm.model_executor": types.ModuleType("vllm.model_executor"),
           "vllm.model_executor.model_loader": types.ModuleType("vllm.model_executor.model_loader"),
           "vllm.model_executor.model_loader.reload": _reload_module()}
    if transfer_api:
        base, factory = _transfer_modules()
        out.update({"vllm.distributed.weight_transfer": types.ModuleType("vllm.distributed.weight_transfer"),
                    "vllm.distributed.weight_transfer.base": base,
                    "vllm.distributed.weight_transfer.factory": factory})
    else:
        out["vllm.distributed.weight_transfer"] = None     # `import` of it raises ImportError
    return out
