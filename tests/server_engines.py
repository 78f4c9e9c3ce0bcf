"""Checks of the engines that run as their own servers (vLLM, SGLang), shared by the tests that
reach them: the pages they export against transformers' K/V, the servers' own counters."""

from __future__ import annotations

import asyncio

import httpx
import numpy as np

from engine_adapters.base import EngineRequest
from tandem_protocol.handoff import FirstTokenMode, PrefillDone
from tandem_protocol.sampling import SamplingParams

from .agents import AgentProcess, pages_of
from .conftest import collect, prompt, run, write_report

# The most FP16 ulps a server's page value may differ from transformers' (see the check below):
# measured 39 (vLLM) and 34 (SGLang) ulps of max(|value|, 1) on SmolLM2's pages, here 1.6x that.
# Was a relative 0.05 of max(|value|, 1): 51 to 102 ulps.
MAX_ULPS = 64


def check_pages_against_transformers(agent: AgentProcess, torch_engine, long_ids: list[int], report: str) -> None:
    """Page bytes from the server's cache against the K/V transformers computes for the same
    prompt (65 and 193 tokens): equal layout, values within MAX_ULPS FP16 ulps (of the value, or
    of 1.0 for values under 1: an absolute floor of MAX_ULPS x 2^-10 near zero)."""
    figures = {}
    for n in (65, 193):
        ids = prompt(long_ids, n)
        got = asyncio.run(pages_of(agent, ids))
        ref = [
            p
            for p in run(
                collect(
                    torch_engine.prefill(EngineRequest(f"ref{n}", ids, SamplingParams(), FirstTokenMode.COMMIT_FIRST))
                )
            )
            if not isinstance(p, PrefillDone)
        ]
        assert [(p.index, p.valid_tokens) for p in got] == [(p.index, p.valid_tokens) for p in ref]
        a = np.concatenate([p.kv for p in got], axis=2).astype(np.float32)
        b = np.concatenate([p.kv for p in ref], axis=2).astype(np.float32)
        diff = np.abs(a - b)
        scale = np.maximum(np.abs(b), 1.0)
        ulps = diff / np.spacing(scale.astype(np.float16)).astype(np.float32)
        figures[n] = {
            "max_abs_diff": float(diff.max()),
            "max_rel_diff": float((diff / scale).max()),
            "max_ulps": float(ulps.max()),
            "mean_abs_diff": float(diff.mean()),
            "max_abs_value": float(np.abs(b).max()),
        }
        # FP16 compute in the server vs float32 compute rounded to FP16
        assert ulps.max() <= MAX_ULPS, figures[n]
    write_report(report, figures)


def server_metrics(url: str) -> str:
    """A server engine's own Prometheus counters (vLLM's and SGLang's /metrics)."""
    return httpx.get(url + "/metrics", timeout=10).text


def counter(metrics: str, name: str, **labels: str) -> float:
    """The sum of a Prometheus counter's samples whose labels include `labels`."""
    total = 0.0
    for line in metrics.splitlines():
        if line.split("{", 1)[0] != name:
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total
