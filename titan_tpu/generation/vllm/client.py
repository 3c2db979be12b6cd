"""One vLLM server over HTTP: its OpenAI-compatible completions with token ids in and out, and the
endpoints that swap its weights (`/pause`, `/collective_rpc` `reload_weights`, `/reset_prefix_cache`,
`/resume`; the server runs with VLLM_SERVER_DEV_MODE=1 for the second and third).

Prompts go in as token ids and completions come back as token ids (`return_tokens_as_token_ids`),
each with the log-probability vLLM computed for it: its raw log-softmax, before temperature and
top-p (vLLM's default `logprobs_mode`), the quantity the trainer's forward gives. Nothing is
detokenised, so nothing is retokenised.
"""

from __future__ import annotations

import http.client
import json
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from titan_tpu.protocols.rollout import SamplingParams


class ServerUnavailable(RuntimeError):
    """The server did not answer (refused, reset, timed out): dead, hung or not started."""


class ServerRefused(RuntimeError):
    """The server answered with an error status (`status`); the message is its own."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class ServedModel:
    url: str
    name: str  # what requests name it (--served-model-name)
    max_model_len: int
    root: str  # the folder (or hub name) the server was started from, as the server sees it


@dataclass(frozen=True)
class Completion:
    tokens: list[int]  # through the stop token, when it stopped at one
    logps: list[float]
    stopped: bool  # by a stop token, not by the token budget


class ServerClient:
    def __init__(self, url: str, timeout: float) -> None:
        self.url = url.rstrip("/")
        self.timeout = timeout

    def _call(self, path: str, body: dict[str, Any] | None = None, timeout: float | None = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            self.url + path,
            data=data,
            method="GET" if body is None else "POST",
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=timeout or self.timeout) as response:
                text = response.read().decode()
        except urllib.error.HTTPError as error:
            detail = error.read().decode(errors="replace")[:500]
            raise ServerRefused(f"{self.url}{path}: HTTP {error.code}: {detail}", error.code) from None
        except (urllib.error.URLError, http.client.HTTPException, ConnectionError, TimeoutError) as error:
            raise ServerUnavailable(f"{self.url}{path}: {getattr(error, 'reason', error)}") from None
        return json.loads(text) if text else None

    def healthy(self, timeout: float = 5.0) -> bool:
        try:
            self._call("/health", timeout=timeout)
        except (ServerUnavailable, ServerRefused):
            return False
        return True

    def served_model(self) -> ServedModel:
        """The one model the server serves."""
        models = self._call("/v1/models")["data"]
        if len(models) != 1:
            raise ServerRefused(f"{self.url}: serves {len(models)} models; a rollout server serves one", 200)
        model = models[0]
        return ServedModel(self.url, model["id"], int(model["max_model_len"]), str(model.get("root") or ""))

    def complete(self, model: str, prompt: Sequence[int], params: SamplingParams, seed: int | None) -> Completion:
        """One completion of `prompt` (token ids). The stop ids are the only stops (the model's own
        end-of-sequence is ignored unless it is among them), as in the builtin sampler."""
        body: dict[str, Any] = {
            "model": model,
            "prompt": list(prompt),
            "max_tokens": params.max_new_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "stop_token_ids": list(params.stop_ids),
            "ignore_eos": True,
            "logprobs": 0,
            "return_tokens_as_token_ids": True,
        }
        if seed is not None:
            body["seed"] = seed
        try:
            choice = self._call("/v1/completions", body)["choices"][0]
        except ServerRefused as refused:
            if refused.status >= 500:
                # A server error on a well-formed request: the engine behind the server is broken (vLLM
                # answers 500 once its engine core died), which a restart may mend.
                raise ServerUnavailable(str(refused)) from None
            raise
        tokens = [int(token.removeprefix("token_id:")) for token in choice["logprobs"]["tokens"]]
        return Completion(tokens, list(choice["logprobs"]["token_logprobs"]), choice["finish_reason"] == "stop")

    def swap_weights(self, folder: str) -> None:
        """Pause generation (in-flight requests finish first), load the Hugging Face folder's weights
        in place, drop the prefix cache (its keys and values came from the old weights), resume."""
        self._call("/pause?mode=wait", {})
        try:
            self._call("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": folder}})
            self._call("/reset_prefix_cache", {})
        finally:
            self._call("/resume", {})
