"""The Triton model's inputs and outputs: names, data types and dims of TensorRT-LLM's Triton backend.

Clients written against TensorRT-LLM's ``inflight_batcher_llm`` models (the ``ensemble`` with ``text_input``,
or ``tensorrt_llm`` with ``input_ids``) send the same tensors here (unless the repository declares its integer
inputs INT64: ``--int64-inputs``, see WIDENED). This table is the one place they are
listed: the config.pbtxt template renders it and the request parser reads by it.

Dims exclude the batch dimension: the model is rendered with ``max_batch_size: 1``, so a scalar input
arrives as ``[1, 1]`` and ``output_ids`` leaves as ``[1, 1, num_tokens]`` ([batch, beam, tokens]), the shapes
TensorRT-LLM's clients use. Every input is optional to Triton; the model checks what it needs and names the
tensor in its error.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

# The inputs ``kiln triton-repo --int64-inputs`` declares INT64 instead of TensorRT-LLM's INT32: tritonserver
# converts a JSON number (HTTP /generate, /infer with JSON data) to the declared type without a range check, so
# 2**32 + 5 reaches an INT32 input as 5; as INT64 it arrives as sent and the model refuses it by name. Typed clients
# must then send INT64 (TensorRT-LLM's send INT32). UINT64 inputs (seed, lora_task_id) stay: they hold every
# 64-bit seed, and a JSON number outside UINT64 is a parse error (500) in tritonserver, not a wrapped value.
WIDENED = frozenset({"TYPE_INT32"})


@dataclass(frozen=True)
class TensorSpec:
    name: str
    data_type: str          # Triton config data type, e.g. "TYPE_INT32"
    dims: tuple[int, ...]   # without the batch dimension
    doc: str

    @property
    def wire_type(self) -> str:
        """The datatype string clients use (tritonclient's InferInput), e.g. "INT32", "BYTES"."""
        return "BYTES" if self.data_type == "TYPE_STRING" else self.data_type.removeprefix("TYPE_")

    def declared(self, int64_inputs: bool) -> TensorSpec:
        """This input as config.pbtxt declares it: with ``int64_inputs`` every integer input is INT64."""
        if int64_inputs and self.data_type in WIDENED:
            return dataclasses.replace(self, data_type="TYPE_INT64")
        return self


INPUTS: tuple[TensorSpec, ...] = (
    TensorSpec("text_input", "TYPE_STRING", (1,), "prompt text (UTF-8); give this or input_ids"),
    TensorSpec("input_ids", "TYPE_INT32", (-1,), "prompt token ids; give this or text_input"),
    TensorSpec("input_lengths", "TYPE_INT32", (1,), "use only the first N input_ids"),
    TensorSpec("max_tokens", "TYPE_INT32", (1,), "required: tokens to generate at most (>= 1)"),
    TensorSpec("stream", "TYPE_BOOL", (1,), "one response per new token(s) (decoupled models only); default false"),
    TensorSpec("temperature", "TYPE_FP32", (1,), ">= 0; 0 decodes greedily"),
    TensorSpec("top_k", "TYPE_INT32", (1,), ">= 0; 0 disables (with top_p 0 or absent too: greedy, as TensorRT-LLM)"),
    TensorSpec("top_p", "TYPE_FP32", (1,), "[0, 1]; 0 disables (with top_k 0 or absent too: greedy, as TensorRT-LLM)"),
    TensorSpec("min_p", "TYPE_FP32", (1,), "[0, 1]; 0 disables (kiln)"),
    TensorSpec("seed", "TYPE_UINT64", (1,), "per-request random seed"),
    TensorSpec("stop_words", "TYPE_STRING", (-1,), "strings that end generation (text_output stops before them)"),
    TensorSpec("bad_words", "TYPE_STRING", (-1,), "not supported: refused unless empty"),
    TensorSpec("end_id", "TYPE_INT32", (1,), "token that ends generation instead of the engine's EOS; -1: none"),
    TensorSpec("pad_id", "TYPE_INT32", (1,), "accepted and ignored (outputs are never padded)"),
    TensorSpec("ignore_eos", "TYPE_BOOL", (1,), "keep generating past EOS (kiln)"),
    TensorSpec("min_tokens", "TYPE_INT32", (1,), ">= 0; EOS and end_id are suppressed until this many tokens"),
    TensorSpec("repetition_penalty", "TYPE_FP32", (1,), "> 0; 1 disables"),
    TensorSpec("presence_penalty", "TYPE_FP32", (1,), "[-2, 2]; 0 disables"),
    TensorSpec("frequency_penalty", "TYPE_FP32", (1,), "[-2, 2]; 0 disables"),
    TensorSpec("beam_width", "TYPE_INT32", (1,), "only 1 (kiln samples one sequence)"),
    TensorSpec("num_return_sequences", "TYPE_INT32", (1,), "only 1"),
    TensorSpec("return_log_probs", "TYPE_BOOL", (1,), "fill cum_log_probs and output_log_probs"),
    TensorSpec("return_context_logits", "TYPE_BOOL", (1,), "not supported: refused if true"),
    TensorSpec("return_generation_logits", "TYPE_BOOL", (1,), "not supported: refused if true"),
    TensorSpec("return_perf_metrics", "TYPE_BOOL", (1,), "accepted; timing and KV outputs come with the last response"),
    TensorSpec("return_num_input_tokens", "TYPE_BOOL", (1,), "accepted; num_input_tokens comes with the last one"),
    TensorSpec("return_num_output_tokens", "TYPE_BOOL", (1,), "accepted; num_output_tokens comes with the last one"),
    TensorSpec("exclude_input_in_output", "TYPE_BOOL", (1,), "non-streaming outputs without the prompt; default false"),
    TensorSpec("priority", "TYPE_INT32", (1,), "scheduling priority, higher first (kiln); default 0"),
    TensorSpec("guided_decoding_guide_type", "TYPE_STRING", (1,),
               "structured output: json (any JSON object), json_schema, regex, ebnf_grammar or structural_tag"),
    TensorSpec("guided_decoding_guide", "TYPE_STRING", (1,),
               "the JSON schema, regex, EBNF grammar or structural tag (JSON) of guided_decoding_guide_type"),
    TensorSpec("lora_name", "TYPE_STRING", (1,), "the loaded LoRA adapter to generate with (kiln); default: none"),
    TensorSpec("lora_task_id", "TYPE_UINT64", (1,), "TensorRT-LLM's adapter id: the adapter loaded under the name "
                                                    "'<id>' (--lora-modules 7=PATH); weights are not sent"),
)

OUTPUTS: tuple[TensorSpec, ...] = (
    TensorSpec("text_output", "TYPE_STRING", (-1,), "text: the new text when streaming, else the whole output"),
    TensorSpec("output_ids", "TYPE_INT32", (-1, -1), "[beam, tokens]: the new tokens when streaming, else all"),
    TensorSpec("sequence_length", "TYPE_INT32", (-1,), "[beam]: number of tokens in output_ids"),
    TensorSpec("cum_log_probs", "TYPE_FP32", (-1,), "[beam]: sum of the generated tokens' log-probabilities so far"),
    TensorSpec("output_log_probs", "TYPE_FP32", (-1, -1), "[beam, tokens]: log-prob of each generated token sent"),
    TensorSpec("finish_reason", "TYPE_STRING", (1,), "last response: stop, length or abort (kiln)"),
    TensorSpec("num_input_tokens", "TYPE_INT32", (1,), "last response: prompt tokens"),
    TensorSpec("num_output_tokens", "TYPE_INT32", (1,), "last response: generated tokens"),
    TensorSpec("kv_cache_reused_blocks", "TYPE_INT32", (1,), "last response: prompt KV blocks from the prefix cache"),
    TensorSpec("kv_cache_alloc_new_blocks", "TYPE_INT32", (1,), "last response: KV blocks the request computed"),
    TensorSpec("kv_cache_alloc_total_blocks", "TYPE_INT32", (1,), "last response: KV blocks the request held"),
    TensorSpec("arrival_time_ns", "TYPE_INT64", (1,), "last response: CLOCK_MONOTONIC ns the request reached kiln"),
    TensorSpec("first_scheduled_time_ns", "TYPE_INT64", (1,), "last response: CLOCK_MONOTONIC ns of its first step"),
    TensorSpec("first_token_time_ns", "TYPE_INT64", (1,), "last response: CLOCK_MONOTONIC ns of its first token"),
    TensorSpec("last_token_time_ns", "TYPE_INT64", (1,), "last response: CLOCK_MONOTONIC ns of its last token"),
)

INPUT_SPECS = {t.name: t for t in INPUTS}
OUTPUT_SPECS = {t.name: t for t in OUTPUTS}
