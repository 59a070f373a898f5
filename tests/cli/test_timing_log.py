"""A call that cannot be captured in a CUDA graph is timed eagerly, and the log names which call it was."""

import contextlib
import logging

import torch

from dispatch.bench import timing


def test_the_eager_fallback_names_the_backend_and_shape(monkeypatch, caplog):
    def refusing_capture(graph):
        raise RuntimeError("operation not permitted when stream is capturing\nmore detail")

    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", object)
    monkeypatch.setattr(torch.cuda, "graph", lambda graph: contextlib.nullcontext(refusing_capture(graph)))
    with caplog.at_level(logging.WARNING, logger=timing.logger.name):
        assert timing._captured([lambda: None], "torch.reference at B=8 N=1") is None
    assert ("timed eagerly (torch.reference at B=8 N=1): the call could not be captured in a CUDA graph: "
            "RuntimeError: operation not permitted when stream is capturing") in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=timing.logger.name):
        assert timing._captured([lambda: None]) is None
    assert "timed eagerly: the call could not be captured" in caplog.text
