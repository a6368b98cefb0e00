"""Multi-turn rollouts and tool calling (`actor_rollout_ref.rollout.tools=tools.yaml`,
`actor_rollout_ref.rollout.multi_turn.*`, `actor_rollout_ref.rollout.interactions`).

    rollout = build_agent_loop(cfg, engine, tokenizer)     # megarl/job/build.py does this
    batch = rollout.generate_sequences(prompts)            # same contract as an engine

tools.py (tools.yaml, argument checks), builtins.py, parser.py (hermes tool calls), executor.py
(threads or Ray actors, timeouts), render.py (tool output as tokens), interactions.py (simulated
users), loop.py (the loop and its metrics).
"""
from __future__ import annotations

import logging

from megarl.data.templates import resolve_chat_template
from megarl.rollout.multiturn.interactions import load_interactions
from megarl.rollout.multiturn.loop import AgentLoop, Trajectory, multiturn_metrics
from megarl.rollout.multiturn.tools import Tool, load_tools

__all__ = ["AgentLoop", "Trajectory", "Tool", "build_agent_loop", "load_tools", "multiturn_metrics",
           "prompt_tool_schemas"]
log = logging.getLogger("megarl.rollout.multiturn")


def build_agent_loop(cfg, engine, tokenizer) -> AgentLoop:
    """The engine wrapped in the agent loop that `cfg` (ExperimentConfig) asks for."""

    mt = cfg.rollout.multi_turn
    tools = load_tools(mt.tool_config_path) if mt.tool_config_path else {}
    interactions = load_interactions(list(cfg.rollout.interactions), mt.interaction_config_path)
    if not tools and not any(fn is not None for fn in interactions.values()):
        log.warning("multi_turn is on without tools or a simulated user: rollouts are single-turn (set "
                    "actor_rollout_ref.rollout.tools=tools.yaml to give the model tools)")
    template = _template(cfg, tokenizer)
    prompt_template = template if _renders_tools(cfg, template, tools) else None
    if tools and mt.tools_in_prompt and prompt_template is None:
        log.warning("the chat template does not render a tool list: the model is told about the tools only "
                    "if the prompts describe them (multi_turn.tools_in_prompt)")
    comm = getattr(engine, "comm", None)
    group = getattr(comm, "group", None) if comm is not None else getattr(engine, "tp_group", None)
    return AgentLoop(engine, tokenizer, tools, mt, template=template, interactions=interactions, tp_group=group,
                     prompt_template=prompt_template)


def prompt_tool_schemas(cfg, tokenizer) -> list[dict] | None:
    """The tool schemas the agent loop renders chat prompts with (tools=..., as it does), or None.
    The dataset renders and measures prompts with the same list, so data.max_prompt_length and
    filter_overlong_prompts count the tokens the engine is given (verl's RLHFDataset does too)."""
    mt = cfg.rollout.multi_turn
    if not (mt.enable and mt.tool_config_path and mt.tools_in_prompt):
        return None
    tools = load_tools(mt.tool_config_path)
    if not _renders_tools(cfg, _template(cfg, tokenizer), tools):
        return None
    return [tool.schema for tool in tools.values()]


def _template(cfg, tokenizer) -> str | None:
    return resolve_chat_template(cfg.data.chat_template, tokenizer) if cfg.data.apply_chat_template else None


def _renders_tools(cfg, template: str | None, tools: dict) -> bool:
    return bool(tools) and cfg.rollout.multi_turn.tools_in_prompt and template is not None and "tools" in template
