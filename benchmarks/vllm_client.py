"""The client side the ``benchmarks/vllm_*`` server scripts share: one request to vLLM's
OpenAI-compatible server on its own connection (the stdlib's ``http.client``), the error message of
a refusal, and a streamed answer read chunk by chunk (server-sent events) with each chunk's arrival
time."""
from __future__ import annotations

import http.client
import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

__all__ = ["HOST", "Streamed", "completion_response", "error_message", "sse_chunks", "stream_completion"]

HOST = "127.0.0.1"


def error_message(raw: bytes) -> str:
    """The ``error.message`` of a refusal's JSON body, else the body as text."""
    text = raw.decode(errors="replace")
    try:
        return json.loads(text).get("error", {}).get("message", text)
    except (ValueError, AttributeError):
        return text


def sse_chunks(resp: http.client.HTTPResponse) -> Iterator[dict]:
    """The JSON chunks of a streamed answer, up to ``data: [DONE]``."""
    for line in resp:
        line = line.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            return
        yield json.loads(data)


@contextmanager
def completion_response(port: int, payload: bytes, *, timeout_s: float, host: str = HOST
                        ) -> Iterator[http.client.HTTPResponse]:
    """POST ``payload`` to ``/v1/completions`` on its own connection (``timeout_s``: each socket wait)
    and yield the response; the connection is closed after (a stream not read to its end: the server
    sees the client gone and aborts the request)."""
    conn = http.client.HTTPConnection(host, port, timeout=timeout_s)
    try:
        conn.request("POST", "/v1/completions", body=payload, headers={"Content-Type": "application/json"})
        yield conn.getresponse()
    finally:
        conn.close()


@dataclass
class Streamed:
    """A streamed completion: HTTP ``status`` (0: no response), the refusal's or the failure's
    ``message``, the ``text``, the seconds from sending to each chunk with text (``chunk_s``), the
    token counts the server reports (``usage``: ``prompt_tokens``, ``completion_tokens``), and the
    seconds from sending to the end (``total_s``)."""

    status: int = 0
    message: str = ""
    text: str = ""
    chunk_s: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0
    total_s: float = 0.0


def stream_completion(port: int, body: dict, *, timeout_s: float) -> Streamed:
    """Send ``body`` to ``/v1/completions`` streamed, with the server's token counts
    (``stream_options.include_usage``), and read the answer; ``timeout_s`` bounds each socket wait
    and the whole answer (past it: ``message`` says so and the connection is closed)."""
    out, t0 = Streamed(), time.monotonic()
    payload = json.dumps({**body, "stream": True, "stream_options": {"include_usage": True}}).encode()
    parts = []
    try:
        with completion_response(port, payload, timeout_s=timeout_s) as resp:
            out.status = resp.status
            if resp.status != 200:
                out.message = error_message(resp.read())
                return out
            for chunk in sse_chunks(resp):
                now = time.monotonic() - t0
                text = "".join(c.get("text", "") for c in chunk.get("choices") or [])
                if text:
                    parts.append(text)
                    out.chunk_s.append(now)
                if chunk.get("usage"):
                    out.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    out.output_tokens = chunk["usage"]["completion_tokens"]
                if now > timeout_s:
                    out.message = f"the answer took more than {timeout_s} s; the client closed it"
                    break
    except (OSError, http.client.HTTPException) as e:
        out.message = f"{type(e).__name__}: {e}"
    finally:
        out.text = "".join(parts)
        out.total_s = time.monotonic() - t0
    return out
