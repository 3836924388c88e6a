"""What flows through the pipeline: the prepared generation, the chosen instance, the collected result."""

from __future__ import annotations

import base64
import io
from array import array
from dataclasses import dataclass, field
from typing import Any, TypeAlias

import numpy as np
from smg_grpc_proto.generated import vllm_engine_pb2

from psrl._wire import packed_uint32
from psrl.router.errors import BadRequest

_INPUT_IDS_FIELD = vllm_engine_pb2.TokenizedInput.DESCRIPTOR.fields_by_name["input_ids"].number
_TOKENIZED_FIELD = vllm_engine_pb2.GenerateRequest.DESCRIPTOR.fields_by_name["tokenized"].number

# A prompt's token ids: a list, or an array('I') where they were read from a JSON body without becoming ints
# (psrl.serving.json_body.loads_token_ids). Both are sequences of ints that packed_uint32 packs.
TokenIds: TypeAlias = "list[int] | array[int]"


@dataclass
class SamplingSpec:
    """Sampling settings in vLLM's terms (top_k -1 = off, max_tokens None = up to the context)."""

    temperature: float | None = None
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    max_tokens: int | None = None
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = None
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    n: int = 1  # choices sampled from the one prompt

    def write_to(self, p: vllm_engine_pb2.SamplingParams) -> None:
        """Set these settings on `p`, a GenerateRequest's own submessage (GenerationInput.to_wire). A plain
        proto3 field left at its zero is not on the wire whether set or not, so only the others are set: each
        assignment costs a call into protobuf, and most requests change two or three settings."""
        p.top_p = self.top_p
        p.repetition_penalty = self.repetition_penalty
        p.skip_special_tokens = self.skip_special_tokens
        p.n = self.n
        if self.top_k > 0:
            p.top_k = self.top_k
        if self.min_p:
            p.min_p = self.min_p
        if self.min_tokens:
            p.min_tokens = self.min_tokens
        if self.stop:
            p.stop.extend(self.stop)
        if self.include_stop_str_in_output:
            p.include_stop_str_in_output = True
        if self.stop_token_ids:
            p.stop_token_ids.extend(self.stop_token_ids)
        if self.ignore_eos:
            p.ignore_eos = True
        if self.presence_penalty:
            p.presence_penalty = self.presence_penalty
        if self.frequency_penalty:
            p.frequency_penalty = self.frequency_penalty
        # proto3 `optional`: set means present, 0 included.
        if self.temperature is not None:
            p.temperature = self.temperature
        if self.max_tokens is not None:
            p.max_tokens = self.max_tokens
        if self.logprobs is not None:
            p.logprobs = self.logprobs
        if self.seed is not None:
            p.seed = self.seed


@dataclass(frozen=True)
class RoutedExperts:
    """One choice's MoE routing: `rows` [n, num_layers, top_k] of expert ids, row i being the token at position
    `prompt_start + i` (prompt positions, then output positions but the last: [prompt_start, P + R - 1))."""

    rows: np.ndarray
    prompt_start: int

    @property
    def num_layers(self) -> int:
        return int(self.rows.shape[1])

    @property
    def top_k(self) -> int:
        return int(self.rows.shape[2])

    def b64_npy(self) -> str:
        """The rows as a base64 .npy file: /generate's meta_info.routed_experts and a TITO record's data."""
        buf = io.BytesIO()
        np.save(buf, self.rows, allow_pickle=False)
        return base64.b64encode(buf.getvalue()).decode("ascii")

    def record(self) -> dict[str, Any]:
        """A TITO record's `routed_experts` (docs/compat.md section 10; psrl.tito.training reads it)."""
        return {
            "data": self.b64_npy(),
            "num_layers": self.num_layers,
            "top_k": self.top_k,
            "dtype": self.rows.dtype.name,
            "prompt_start": self.prompt_start,
        }


@dataclass
class GenerationInput:
    """One prompt, ready for a replica."""

    request_id: str
    prompt_ids: TokenIds
    sampling: SamplingSpec
    stream: bool = False
    kv_transfer_params_json: str = ""  # a looped-back request: where its KV is (see Dispatcher.kv_transfer_params)
    # Ask the replica for the routed experts of positions from this one on (None: not asked). Sent as Generate
    # metadata (the stock proto has no field); a looped-back request asks from where the last segment ended.
    routed_experts_start: int | None = None

    def to_wire(self, dp_rank: int) -> bytes:
        """The serialized GenerateRequest. The prompt goes last, as the `tokenized` field's bytes packed in C: a
        message's fields may come in any order, and set through protobuf the ids were parsed and encoded again."""
        # Built in place: submessages given to the constructor are copied in, which took twice the CPU.
        request = vllm_engine_pb2.GenerateRequest(
            request_id=self.request_id, stream=self.stream, data_parallel_rank=dp_rank
        )
        request.sampling_params.SetInParent()  # present even if every setting were proto3's default
        self.sampling.write_to(request.sampling_params)
        # proto3 `optional`: assigning "" marks the field present, and vLLM's servicer then parses it as JSON.
        if self.kv_transfer_params_json:
            request.kv_transfer_params_json = self.kv_transfer_params_json
        return request.SerializeToString() + tokenized_field(self.prompt_ids)


def tokenized_field(prompt_ids: TokenIds) -> bytes:
    """A GenerateRequest's `tokenized` field holding these ids, as bytes to append to the rest of the request."""
    try:
        return packed_uint32(_INPUT_IDS_FIELD, prompt_ids, _TOKENIZED_FIELD)
    except (TypeError, OverflowError) as e:  # parse checked a client's ids already: a bug upstream
        raise BadRequest(f"the prompt's token ids are not uint32s: {e}") from None


def extended(prompt_ids: TokenIds, more: list[int]) -> TokenIds:
    """The prompt's ids followed by `more`, in the prompt's own kind of sequence."""
    if isinstance(prompt_ids, array):
        return prompt_ids + array("I", more)
    return prompt_ids + more


@dataclass
class Generation:
    """Everything one choice of a request produced, accumulated the way SMG does it."""

    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    finish_reason: str | None = None
    matched_stop_token_id: int | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    kv_moved_tokens: int | None = None  # a loop-back with kv_transfer_params: prompt tokens whose KV moved in
    matched_stop_str: str | None = None  # the stop string the replica stopped at (its ids may run past it)
    routed_experts: RoutedExperts | None = None  # when asked and the replica recorded them

    @property
    def completion_tokens(self) -> int:
        return len(self.output_ids)

    @property
    def stop_reason(self) -> str | int | None:
        """vLLM's `stop_reason`: the stop string or stop token id that ended the choice (None for EOS)."""
        return self.matched_stop_str if self.matched_stop_str is not None else self.matched_stop_token_id
