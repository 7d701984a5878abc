"""The OpenAI request bodies kvpool serve accepts, and its error shape."""

from __future__ import annotations

from typing import Literal, Union

from pydantic import BaseModel, ConfigDict, Field

from ..engine import SamplingParams
from ..errors import InvalidArgument

#: every generated token is matched against each stop string and id on the engine thread, which serves every
#: request: a request cannot make that cost unbounded (OpenAI's own limit is 4 strings)
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 64


class _Sampling(BaseModel):
    # unknown fields are ignored, as OpenAI-compatible servers commonly do
    model_config = ConfigDict(extra="ignore")

    model: str
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)  # an extension (extra_body)
    seed: int | None = None
    stop: Union[str, list[str], None] = None
    stop_token_ids: list[int] = []  # an extension
    ignore_eos: bool = False  # an extension
    n: int = 1
    stream: bool = False
    stream_options: dict | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: Union[bool, int, None] = None

    def check_supported(self) -> None:
        """Raises InvalidArgument for what this server does not do (rather than ignoring it silently)."""
        if self.n != 1:
            raise InvalidArgument("n must be 1: one choice per request")
        if self.presence_penalty or self.frequency_penalty:
            raise InvalidArgument("presence_penalty and frequency_penalty are not supported")
        if self.logprobs:
            raise InvalidArgument("logprobs are not supported")
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        if len(stops) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_STRING_CHARS for s in stops):
            raise InvalidArgument(f"stop takes at most {MAX_STOP_STRINGS} strings of at most "
                                  f"{MAX_STOP_STRING_CHARS} characters each")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidArgument(f"stop_token_ids takes at most {MAX_STOP_TOKEN_IDS} ids")

    def params(self, max_tokens: int) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        return SamplingParams(max_tokens=max_tokens, temperature=self.temperature, top_k=self.top_k,
                              top_p=self.top_p, seed=self.seed, stop=tuple(stop),
                              stop_token_ids=tuple(self.stop_token_ids), ignore_eos=self.ignore_eos)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.get("include_usage"))


class CompletionRequest(_Sampling):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: int | None = Field(16, ge=1)
    echo: bool = False

    def prompt_one(self) -> str | list[int]:
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise InvalidArgument("one prompt per request (send several requests)")
            p = p[0]
        if self.echo:
            raise InvalidArgument("echo is not supported")
        return p


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Union[str, list[dict], None] = None


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    tools: list | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.tools:
            raise InvalidArgument("tools are not supported")


def error_body(message: str, *, type_: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    """The OpenAI error JSON: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
