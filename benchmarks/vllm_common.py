"""What the ``benchmarks/vllm_*`` scripts share besides the engine launcher
(:mod:`kvsieve.eval.served.launch`: environment, model folder, modes): the prompts' filler text and
the ``--modes`` syntax, and one of vLLM's counters read from an offline engine."""
from __future__ import annotations

__all__ = ["FILLER", "parse_modes", "vllm_metric"]

#: the repeated sentence the scripts build their prompts from (about 30 tokens)
FILLER = ("The archive kept letters from sailors, merchants and clerks; each described the weather, the cargo, "
          "the price of grain and the names of the harbours they passed. ")


def parse_modes(text: str) -> list[str]:
    """``own,dense,quest:budget=256,page_size=128`` -> modes: a comma starts a new mode unless the
    next item is a ``key=value`` of the current selector; with a ``;`` anywhere, ``;`` alone
    separates the modes."""
    if ";" in text:
        return text.split(";")
    modes: list[str] = []
    for item in text.split(","):
        if "=" in item and ":" not in item and modes and ":" in modes[-1]:
            modes[-1] += "," + item
        else:
            modes.append(item)
    return modes


def vllm_metric(llm, name: str) -> float:  # noqa: ANN001 (vllm.LLM: this module does not import vLLM)
    """vLLM's counter ``name`` (e.g. ``vllm:prefix_cache_hits``) summed over its labels, from an
    offline engine built with ``disable_log_stats=False``; an absent counter is an error naming it."""
    values = [m.value for m in llm.get_metrics() if m.name == name]
    if not values:
        raise RuntimeError(f"vLLM reports no metric {name!r} (is log_stats on?)")
    return float(sum(values))
