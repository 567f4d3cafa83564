# SPDX-License-Identifier: Apache-2.0
"""Request-supplied chat templates (--trust-request-chat-template), rendered in a child process.

A Jinja template is a program: nested loops can keep a CPU busy for minutes, and a rendering
thread cannot be stopped. So a request's template runs in a process of its own, one render at a
time, under a time limit, an output-size limit and a memory limit; past the time limit, or when
the client goes away, the process is killed (its work stops with it) and a fresh one started.
The server's own template (the tokenizer's or --chat-template) is trusted and renders in the
server process.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import resource
from multiprocessing.connection import Connection
from typing import Any

logger = logging.getLogger(__name__)

MEMORY_BUDGET_BYTES = 1 << 30
"""Address space a render may add to the child's start-up size (RLIMIT_AS)."""

STARTUP_TIMEOUT_S = 120.0


class TemplateRenderError(ValueError):
    """The request's template failed, ran too long or rendered too much (the client's fault)."""


def _worker_main(conn: Connection, tokenizer_path: str, max_chars: int) -> None:
    """Child: load the tokenizer, cap the address space, then render until the pipe closes."""
    from transformers import AutoTokenizer

    from kdaserve.entrypoints.chat_utils import render_chat

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    with open("/proc/self/statm") as f:
        vm_bytes = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    limit = vm_bytes + MEMORY_BUDGET_BYTES
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    conn.send(("ready", None))
    while True:
        try:
            messages, kwargs = conn.recv()
        except (EOFError, OSError):
            return
        try:
            text = render_chat(tokenizer, messages, **kwargs)
            if len(text) > max_chars:
                reply = ("error", f"the chat template rendered more than {max_chars} characters")
            else:
                reply = ("ok", text)
        except MemoryError:
            reply = ("error", "the chat template needed too much memory")
        except Exception as e:  # noqa: BLE001 - template errors are the request's fault
            reply = ("error", f"the chat template failed on these messages: {e}")
        conn.send(reply)


class RequestTemplateRenderer:
    """tokenizer_path: the tokenizer the child loads (its special tokens are template
    variables); timeout_s: wall time one render may take; max_chars: the most characters a
    render may return (more could not fit the context)."""

    def __init__(self, tokenizer_path: str, timeout_s: float, max_chars: int):
        self.tokenizer_path = tokenizer_path
        self.timeout_s = timeout_s
        self.max_chars = max_chars
        self._ctx = multiprocessing.get_context("spawn")
        self._proc: multiprocessing.process.BaseProcess | None = None
        self._conn: Connection | None = None
        self._ready = False
        self._lock = asyncio.Lock()

    def start(self) -> None:
        """Spawn the child (it loads in the background; render() waits for it)."""
        parent, child = self._ctx.Pipe()
        self._proc = self._ctx.Process(target=_worker_main, name="kdaserve-template-sandbox",
                                       args=(child, self.tokenizer_path, self.max_chars),
                                       daemon=True)
        self._proc.start()
        child.close()
        self._conn = parent
        self._ready = False

    def kill(self) -> None:
        if self._proc is not None and self._proc.is_alive():
            self._proc.kill()
            self._proc.join(5)
        if self._conn is not None:
            self._conn.close()
        self._proc = self._conn = None

    def _restart(self) -> None:
        """Kill the child (stopping its render) and start the next one loading."""
        self.kill()
        self.start()

    async def _recv(self, timeout: float) -> tuple[str, Any]:
        conn = self._conn
        if not await asyncio.to_thread(conn.poll, timeout):
            raise TimeoutError
        return conn.recv()

    async def render(self, messages: list[dict[str, Any]], **kwargs: Any) -> str:
        """render_chat(...) in the child; TemplateRenderError for anything the template did
        wrong. Cancelling the caller kills the child."""
        async with self._lock:
            if self._proc is None or not self._proc.is_alive():
                self.kill()
                self.start()
            try:
                if not self._ready:
                    try:
                        await self._recv(STARTUP_TIMEOUT_S)
                    except (TimeoutError, EOFError, OSError) as e:
                        raise RuntimeError("the chat template sandbox did not start") from e
                    self._ready = True
                try:
                    await asyncio.to_thread(self._conn.send, (messages, kwargs))
                except (RecursionError, TypeError, ValueError) as e:
                    raise TemplateRenderError(f"the chat template inputs cannot be sent to "
                                              f"the sandbox: {e}") from None
                try:
                    status, value = await self._recv(self.timeout_s)
                except TimeoutError:
                    self._restart()
                    raise TemplateRenderError(
                        f"the chat template did not finish rendering in {self.timeout_s:g} s")
                except (EOFError, OSError):
                    self._restart()
                    raise TemplateRenderError("the chat template crashed its sandbox") from None
            except TemplateRenderError:
                raise
            except BaseException:  # cancelled (the client left) or broken: stop the render
                self._restart()
                raise
        if status != "ok":
            raise TemplateRenderError(value)
        return value
