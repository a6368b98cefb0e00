"""A user's rollout class (`rollout.name=custom`, `custom_cls_path`, `custom_cls_name`).

The class subclasses megarl.rollout.base.BaseRollout and overrides either

    generate(prompts: list[list[int]], sampling) -> list[list[Completion]]      (token level), or
    generate_sequences(batch: DataProto) -> DataProto                           (verl's form)

and implements update_weights(bucket) and finalize_weights() (megarl/rollout/base.py): the trainer
syncs the policy's weights into it before every step, so a class without them is refused when built.

In the second form the input batch has one row per prompt with `prompt_token_ids`, `prompts`
(the decoded text, when a tokenizer is known) and `meta_info["sampling"]`; the returned batch
must have n rows per prompt, the n of one prompt adjacent (`batch.repeat(n)`; with n=1 the
seed's `batch.clone()` works as written), with

    responses   list of strings, list of token-id lists, or a right-padded token tensor [R, W]
                (the row lengths then come from `response_mask`, else `response_lengths`)
    log_probs   list of per-token lists, or a right-padded tensor [R, >= tokens] (padding 0)
    finish_reasons (optional) "stop" | "length" | "abort"; otherwise inferred from the stop ids

`CustomRollout` adapts that into the token-level contract and the protocol's fields; lengths
that do not line up are refused with the row and the numbers.

The class declares what it can do as class attributes, read by megarl/engines EngineInfo.declared_by;
each left out keeps the conservative default:

    devices = ("cuda",)                   # torch device types it runs on (default: cpu and cuda)
    records_routes = True                 # its Completions carry routed_experts (R3); token-level form only
    exact_logprob_dtypes = ("float32",)   # its log-probs are the trainer's there (bypass_mode=null skips
                                          # the old-log-prob pass, checked every step)
    captures_cuda_graphs = True           # rollout.enforce_eager=false reaches it through the config
    takes_hf_overrides = True             # built with hf_overrides=<dict>: model.override_config's HF keys,
                                          # to apply to its model (else a non-empty one is refused)
"""
from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
from collections.abc import Iterable

import numpy as np
import torch

from megarl.config.errors import ConfigError
from megarl.protocol import DataProto
from megarl.rollout.base import (BaseRollout, Completion, RolloutEngine, SamplingParams, generate_sequences_via,
                                pack_completions)
from megarl.rollout.build_args import BuildRequest, pad_id, vocab_size
from megarl.rollout.config import check_engine_asks
from megarl.rollout.prompts import PromptGuard

_KEY = "actor_rollout_ref.rollout"


def load_user_class(path: str, name: str) -> type:
    """`path`: a .py file or a dotted module; the class must subclass BaseRollout."""
    if path.endswith(".py") or os.sep in path:
        if not os.path.isfile(path):
            raise ConfigError(f"{path} does not exist (a .py file or a module path is expected)",
                              f"{_KEY}.custom_cls_path")
        mod_name = "megarl_user_rollout_" + hashlib.sha1(os.path.abspath(path).encode()).hexdigest()[:10]
        spec = importlib.util.spec_from_file_location(mod_name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(path)
        except ImportError as err:
            raise ConfigError(f"cannot import {path!r}: {err}", f"{_KEY}.custom_cls_path") from err
    cls = getattr(module, name, None)
    if cls is None:
        found = sorted(k for k, v in vars(module).items() if isinstance(v, type) and v.__module__ == module.__name__)
        raise ConfigError(f"{path} has no class {name!r} (classes there: {', '.join(found) or 'none'})",
                          f"{_KEY}.custom_cls_name")
    if not (isinstance(cls, type) and issubclass(cls, BaseRollout)):
        raise ConfigError(f"{name} in {path} must subclass megarl.rollout.base.BaseRollout "
                          "(from megarl.rollout.base import BaseRollout)", f"{_KEY}.custom_cls_name")
    return cls


def _overrides(obj: object, method: str) -> bool:
    return getattr(type(obj), method) is not getattr(BaseRollout, method)


def unimplemented(cls: type) -> str:
    """What a training run calls that `cls` leaves to BaseRollout's refusals, in one line, or "".
    The trainer syncs the policy into its engine before every generation, so a class without the
    weight methods would be refused at the first sync, after the models were built."""
    if cls.generate is BaseRollout.generate and cls.generate_sequences is BaseRollout.generate_sequences:
        return f"{cls.__name__} overrides neither generate() nor generate_sequences()"
    missing = [f"{m}()" for m in ("update_weights", "finalize_weights") if getattr(cls, m) is getattr(BaseRollout, m)]
    if missing:
        return (f"{cls.__name__} does not implement {' or '.join(missing)}: the trainer syncs the policy's weights "
                "into its rollout engine before every step; implement update_weights(bucket) and "
                "finalize_weights() (megarl/rollout/base.py)")
    return ""


def _rows(value, what: str) -> list:
    if isinstance(value, torch.Tensor):
        return list(value.unbind(0)) if value.dim() > 1 else [value]
    return list(value)


def completions_from_batch(out: DataProto, n_prompts: int, sampling: SamplingParams, tokenizer=None
                           ) -> list[list[Completion]]:
    """A user's returned batch -> n Completions per prompt (refusing inconsistent lengths)."""
    n, who = sampling.n, "custom rollout"
    try:
        responses = out.responses
    except AttributeError:
        raise ValueError(f"{who}: the returned batch has no `responses` (set output_batch.responses)") from None
    logp = None
    for key in ("log_probs", "rollout_log_probs"):
        if key in out:
            logp = out[key]
            break
    if logp is None:
        raise ValueError(f"{who}: the returned batch has no `log_probs` (set output_batch.log_probs: the "
                         "log-prob of every response token under the policy, needed for PPO/GRPO ratios)")
    responses, logp = _rows(responses, "responses"), _rows(logp, "log_probs")
    if len(responses) != n_prompts * n:
        raise ValueError(f"{who}: {len(responses)} responses for {n_prompts} prompts x n={n}; return n responses "
                         "per prompt, the n of one prompt adjacent (output_batch = batch.repeat(n, interleave=True))")
    if len(logp) != len(responses):
        raise ValueError(f"{who}: {len(logp)} log_probs rows for {len(responses)} responses")
    lengths = None
    if isinstance(out.responses, torch.Tensor):
        if "response_mask" in out:
            lengths = out["response_mask"].sum(-1).tolist()
        elif "response_lengths" in out:
            lengths = torch.as_tensor(out["response_lengths"]).tolist()
    reasons = list(out["finish_reasons"]) if "finish_reasons" in out else None
    stops = sampling.stop_ids
    groups: list[list[Completion]] = []
    for i, (resp, lp) in enumerate(zip(responses, logp)):
        if isinstance(resp, str):
            if tokenizer is None:
                raise ValueError(f"{who}: responses are strings but no tokenizer was given to build_rollout")
            toks = tokenizer.encode(resp, add_special_tokens=False)
        elif isinstance(resp, torch.Tensor):
            toks = resp.tolist()[: int(lengths[i]) if lengths is not None else None]
        else:
            toks = [int(t) for t in resp]
        if isinstance(lp, torch.Tensor):
            if lp.numel() < len(toks):
                raise ValueError(f"{who}: response {i} has {len(toks)} tokens but only {lp.numel()} log_probs")
            if bool((lp[len(toks):] != 0).any()):
                raise ValueError(f"{who}: response {i} has {len(toks)} tokens but non-zero log_probs past them "
                                 "(did re-tokenizing the text change the token count? return token ids instead)")
            lp = lp[: len(toks)].tolist()
        else:
            lp = [float(x) for x in lp]
            if len(lp) != len(toks):
                raise ValueError(f"{who}: response {i} has {len(toks)} tokens but {len(lp)} log_probs")
        if reasons is not None:
            reason = str(reasons[i])
        elif toks and toks[-1] in stops:
            reason = "stop"
        else:
            reason = "length" if len(toks) >= sampling.max_tokens else "stop"
        if i % n == 0:
            groups.append([])
        groups[-1].append(Completion(toks, lp, reason))
    return groups


class CustomRollout(RolloutEngine):
    """Wraps a user's BaseRollout so it serves both `generate` and `generate_sequences`."""

    def __init__(self, user: BaseRollout, *, tokenizer=None, guard: PromptGuard | None = None, pad_token_id: int = 0):
        if not (_overrides(user, "generate") or _overrides(user, "generate_sequences")):
            raise ConfigError(f"{type(user).__name__} overrides neither generate() nor generate_sequences()",
                              f"{_KEY}.custom_cls_name")
        self.user, self.tokenizer, self.pad_token_id = user, tokenizer, pad_token_id
        self.guard = guard or PromptGuard()

    def _batch(self, prompts: list[list[int]], sampling: SamplingParams) -> DataProto:
        nt = {"prompt_token_ids": np.array([None] * len(prompts), dtype=object)}
        for i, p in enumerate(prompts):
            nt["prompt_token_ids"][i] = list(p)
        if self.tokenizer is not None:
            nt["prompts"] = [self.tokenizer.decode(p) for p in prompts]
        return DataProto(non_tensor_batch=nt, meta_info={"sampling": sampling, "n": sampling.n,
                                                          "pad_token_id": self.pad_token_id})

    def generate(self, prompts: list[list[int]], sampling: SamplingParams,
                 prompt_limit: int | None = None) -> list[list[Completion]]:
        sampling.validate()
        prompts = self.guard.apply(prompts, max_length=prompt_limit)
        if _overrides(self.user, "generate"):
            groups = self.user.generate(prompts, sampling)
            if len(groups) != len(prompts) or any(len(g) != sampling.n for g in groups):
                raise ValueError(f"custom rollout: generate() must return {sampling.n} completions for each of "
                                 f"{len(prompts)} prompts")
            for g in groups:
                for c in g:
                    if len(c.log_probs) != len(c.token_ids):
                        raise ValueError(f"custom rollout: a completion has {len(c.token_ids)} tokens but "
                                         f"{len(c.log_probs)} log_probs")
            return groups
        out = self.user.generate_sequences(self._batch(prompts, sampling))
        return completions_from_batch(out, len(prompts), sampling, self.tokenizer)

    def generate_sequences(self, batch: DataProto) -> DataProto:
        """A data batch (one row per prompt, `prompt_token_ids`, meta `sampling`) -> protocol fields.
        A user's generate_sequences sees the data batch itself (raw_prompt, reward_model, ...)."""
        pad = batch.meta_info.get("pad_token_id", self.pad_token_id)
        if _overrides(self.user, "generate"):
            return generate_sequences_via(self, batch, pad)
        sampling: SamplingParams = batch.meta_info["sampling"]
        sampling.validate()
        prompts = self.guard.apply([list(p) for p in batch.non_tensor_batch["prompt_token_ids"]])
        ids = self._batch(prompts, sampling).non_tensor_batch
        batch.non_tensor_batch["prompt_token_ids"] = ids["prompt_token_ids"]
        if "prompts" not in batch and "prompts" in ids:
            batch.non_tensor_batch["prompts"] = ids["prompts"]
        batch.meta_info.setdefault("n", sampling.n)
        out = self.user.generate_sequences(batch.clone())
        groups = completions_from_batch(out, len(prompts), sampling, self.tokenizer)
        return pack_completions(batch, groups, pad_token_id=pad)

    def update_weights(self, bucket: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.user.update_weights(bucket)

    def finalize_weights(self) -> None:
        self.user.finalize_weights()

    def abort_weight_update(self) -> None:
        self.user.abort_weight_update()

    def sleep(self) -> None:
        self.user.sleep()

    def wake(self) -> None:
        self.user.wake()


def build_custom(req: BuildRequest) -> CustomRollout:
    """The user's class from custom_cls_path / custom_cls_name (declared in megarl/engines/custom.py),
    refused here when the config asks what the class does not declare."""
    cfg = req.cfg
    cls = load_user_class(cfg.custom_cls_path, cfg.custom_cls_name)
    info = req.info.declared_by(cls)
    check_engine_asks(cfg, info, _KEY)
    refusal = info.overrides_refusal(sorted(req.hf_overrides))
    if refusal:
        raise ConfigError(f"{cls.__name__}: {refusal}", "actor_rollout_ref.model.override_config")
    if getattr(cls, "records_routes", False) and cls.generate is BaseRollout.generate:
        raise ConfigError(f"{cls.__name__} declares records_routes but routes reach the batch only through "
                          "generate() (Completion.routed_experts); override generate()", f"{_KEY}.custom_cls_name")
    missing = unimplemented(cls)
    if missing:
        raise ConfigError(missing, f"{_KEY}.custom_cls_name")
    try:
        given = {"hf_overrides": dict(req.hf_overrides)} if info.takes_hf_overrides else {}
        user_engine = cls(cfg, req.role, **given, **req.user_kwargs)
    except TypeError as err:
        raise ConfigError(f"{cls.__name__}(config, role, **engine_kwargs.custom) failed: {err}",
                          f"{_KEY}.custom_cls_name") from err
    guard = PromptGuard(cfg.prompt_length, cfg.prompt_truncation, vocab_size=vocab_size(req.model_path, req.tokenizer))
    return CustomRollout(user_engine, tokenizer=req.tokenizer, guard=guard, pad_token_id=pad_id(req.tokenizer))
