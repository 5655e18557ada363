"""kiln.contract: what passes between the builder and the runtime, written once.

The engine's I/O contract (input names, dtypes, dynamic dims, the KV pool's shape and bytes per token,
the one packer of scheduled sequences into inputs), the engine directory format (file names, format
version, the typed EngineConfig and its compatibility check, the summary both CLIs print) and kiln's
error family. Every other kiln package may import it; it imports only torch and the standard library.
"""

from kiln.contract.engine_config import (
    BACKENDS,
    CONFIG_FILE,
    FORMAT_VERSION,
    QUANTIZATIONS,
    REPORT_FILE,
    SUPPORTED_FORMAT_VERSIONS,
    TOKENIZER_FILES,
    TORCH_BACKENDS,
    EngineBounds,
    EngineConfig,
    MemorySummary,
    TokenizerInfo,
    check_compatible,
    file_checksum,
    is_engine_dir,
    rank_file,
    read_build_report,
    read_engine_config,
    verify_checksums,
)
from kiln.contract.errors import (
    AdapterLoadError,
    BuildConfigError,
    CheckpointError,
    ConfigError,
    EngineBuildError,
    EngineDeadError,
    EngineInputError,
    EngineLoadError,
    ExecutorClosedError,
    InvalidRequestError,
    KilnError,
    RequestFailedError,
)
from kiln.contract.io import (
    DTYPES,
    INDEX_DTYPES,
    INPUT_AXES,
    INPUT_NAMES,
    KV_CACHE_DTYPES,
    KV_CACHE_OUTPUT,
    KV_SCALE_BYTES,
    OUTPUT_NAME,
    QUANTIZED_KV_DTYPES,
    SeqChunk,
    check_inputs,
    dim_ranges,
    input_axes,
    input_names,
    io_spec,
    kv_bytes_per_token,
    kv_cache_shape,
    kv_row_size,
    pack_inputs,
    torch_dtype,
)
from kiln.contract.lora import LORA_INPUT_NAMES, NO_ADAPTER, LoraLayout, LoraModule
from kiln.contract.model import LAYER_TYPES, ModelConfig
from kiln.contract.options import check_option_names, option_names, reject_unknown_options
from kiln.contract.summary import format_table, human_bytes, summary_rows
from kiln.contract.tensor_parallel import TensorParallelMapping, check_rank_file, mapping_problems, stamp_rank_file
from kiln.contract.weights import load_weights, save_weights, weights_file

__all__ = [
    "BACKENDS", "CONFIG_FILE", "DTYPES", "FORMAT_VERSION", "INDEX_DTYPES", "INPUT_AXES", "INPUT_NAMES",
    "KV_CACHE_DTYPES", "KV_CACHE_OUTPUT", "KV_SCALE_BYTES", "LAYER_TYPES", "LORA_INPUT_NAMES", "NO_ADAPTER",
    "OUTPUT_NAME", "QUANTIZATIONS", "QUANTIZED_KV_DTYPES", "REPORT_FILE", "SUPPORTED_FORMAT_VERSIONS",
    "TOKENIZER_FILES", "TORCH_BACKENDS",
    "AdapterLoadError", "BuildConfigError", "CheckpointError", "ConfigError", "EngineBounds", "EngineBuildError",
    "EngineConfig",
    "EngineDeadError", "EngineInputError",
    "EngineLoadError", "ExecutorClosedError", "InvalidRequestError", "KilnError", "LoraLayout", "LoraModule",
    "MemorySummary", "ModelConfig",
    "RequestFailedError", "SeqChunk", "TensorParallelMapping", "TokenizerInfo",
    "check_compatible", "check_inputs", "dim_ranges", "input_axes", "input_names", "format_table", "human_bytes",
    "io_spec", "is_engine_dir",
    "kv_bytes_per_token", "kv_cache_shape", "kv_row_size", "pack_inputs", "rank_file", "read_build_report",
    "read_engine_config",
    "summary_rows", "torch_dtype", "file_checksum", "verify_checksums", "check_rank_file", "mapping_problems",
    "stamp_rank_file", "load_weights", "save_weights", "weights_file", "check_option_names", "option_names",
    "reject_unknown_options",
]
