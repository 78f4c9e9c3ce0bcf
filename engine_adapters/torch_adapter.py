"""transformers (PyTorch) engine: CUDA in FP16, CPU in float32 with FP16 KV storage."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import torch
from transformers import AttentionInterface, AttentionMaskInterface, AutoModelForCausalLM
from transformers.cache_utils import Cache, DynamicLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask
from transformers.utils import logging as hf_logging

from tandem_protocol import fp8 as fp8_codec
from tandem_protocol import int8 as int8_codec
from tandem_protocol.pages import FP8_E4M3, INT8, LOSSY, KVPage, PageGeometry

from .in_process import InProcessEngine

CUDA_PREFILL_CHUNK_TOKENS = 2048  # measured on an H200: bench/results/gpu-h200-prefill-chunks-*.txt

NOT_FINITE = 127  # a block exponent no FP8 page has: the block held an infinity or NaN


def fp8_refused(payloads: np.ndarray, geometry: PageGeometry) -> bool:
    """Whether a block of these payloads (rows of fp8_payloads) held an infinity or NaN."""
    blocks = geometry.layers * 2 * geometry.kv_heads
    return bool((payloads[:, :blocks].view(np.int8) == NOT_FINITE).any())


def fp8_payloads(pages: torch.Tensor) -> torch.Tensor:
    """FP16 pages [pages][layers][2][page_tokens][kv_heads][head_dim], on any device, as their FP8
    payloads (fp8.py's layout: the int8 block exponents, then the E4M3 codes), one uint8 row a
    page, computed where the pages are. Byte for byte what `fp8.encode` makes of each page: a
    block's exponent is the smallest e with max|x| / 2**e <= 448, and scaling by a power of two
    is exact, so torch's cast (nearest, ties to even) is the codec's table
    (tests/unit/test_fp8.py checks every FP16 value under every exponent). A block holding an
    infinity or NaN gets exponent NOT_FINITE (no sync with the device here: `fp8_refused` checks
    the payloads on the host)."""
    amax = pages.abs().amax(dim=(3, 5)).float()  # [pages][layers][2][kv_heads]
    # ceil(log2(amax / 448)) exactly: frexp gives m in [0.5, 1) with amax / 448 = m * 2**k (the
    # quotient rounds to 2**j only when it is exactly 2**j: FP16 magnitudes are far coarser)
    m, k = torch.frexp(amax / fp8_codec.E4M3_MAX)
    e = torch.where(m == 0.5, k - 1, k)
    e = torch.where(amax > 0, e, fp8_codec.EXP_MIN).clamp(fp8_codec.EXP_MIN, fp8_codec.EXP_MAX)
    e = torch.where(torch.isfinite(amax), e, NOT_FINITE)
    scale = _pow2(-e)[:, :, :, None, :, None]
    codes = (pages.float() * scale).to(torch.float8_e4m3fn).view(torch.uint8)
    return torch.cat([e.to(torch.int8).view(torch.uint8).flatten(1), codes.flatten(1)], dim=1)


def fp8_decoded(payloads: torch.Tensor, geometry: PageGeometry) -> torch.Tensor:
    """FP8 payloads (uint8 rows in fp8.py's layout, on any device) as FP16 pages
    [pages][layers][2][page_tokens][kv_heads][head_dim], computed where they are. Byte for byte
    what `fp8.decode` makes of each: a code's value times 2**e is exact in float32, the two NaN
    codes read as 0, a value past FP16's range is clamped to 65504, then one rounding to FP16, as
    the codec's table (tests/unit/test_fp8_device.py)."""
    g = geometry
    blocks = g.layers * 2 * g.kv_heads
    e = payloads[:, :blocks].view(torch.int8).view(-1, g.layers, 2, 1, g.kv_heads, 1)
    codes = payloads[:, blocks:].view(torch.float8_e4m3fn).view(-1, *g.page_shape)
    values = torch.nan_to_num(codes.float(), nan=0.0) * _pow2(e)
    return values.clamp(-fp8_codec.FP16_MAX, fp8_codec.FP16_MAX).to(torch.float16)


def int8_payloads(pages: torch.Tensor) -> torch.Tensor:
    """FP16 pages [pages][layers][2][page_tokens][kv_heads][head_dim], on any device, as their INT8
    payloads (int8.py's layout: K's per-channel scales, V's per-token scales, then the codes), one
    uint8 row a page, computed where the pages are. Byte for byte what `int8.encode` makes of each
    page: the same float32 operations (max |x| / 127 rounded up to FP16; x times the scale's
    float32 reciprocal, rounded half to even, clamped to +-127). A block holding an infinity or NaN
    gets a non-finite scale (no sync with the device here: `int8_refused` checks on the host)."""
    magnitude = pages.abs()
    k_scale = _int8_scale(magnitude[:, :, 0].amax(dim=2))  # over tokens: [pages][layers][heads][dim]
    v_scale = _int8_scale(magnitude[:, :, 1].amax(dim=4))  # over head_dim: [pages][layers][tokens][heads]
    x = pages.float()
    k = x[:, :, 0] * _reciprocal(k_scale)[:, :, None]
    v = x[:, :, 1] * _reciprocal(v_scale)[..., None]
    codes = torch.stack([k, v], dim=2).round_().clamp_(-int8_codec.CODE_MAX, int8_codec.CODE_MAX).to(torch.int8)
    rows = (k_scale.flatten(1), v_scale.flatten(1), codes.flatten(1))
    return torch.cat([r.view(torch.uint8) for r in rows], dim=1)


def int8_refused(payloads: np.ndarray, geometry: PageGeometry) -> bool:
    """Whether a scale of these payloads (rows of int8_payloads) is an infinity or NaN."""
    n_k, n_v = int8_codec.scale_counts(geometry.layers, geometry.kv_heads, geometry.head_dim, geometry.page_tokens)
    return bool(((payloads[:, : 2 * (n_k + n_v)].view(np.uint16) & 0x7FFF) >= 0x7C00).any())


def int8_decoded(payloads: torch.Tensor, geometry: PageGeometry) -> torch.Tensor:
    """INT8 payloads (uint8 rows in int8.py's layout, on any device) as FP16 pages
    [pages][layers][2][page_tokens][kv_heads][head_dim], computed where they are. Byte for byte
    what `int8.decode` makes of each: code times scale in float32, clamped to FP16's range, one
    rounding to FP16 (tests/unit/test_lossy_device.py)."""
    g = geometry
    n_k, n_v = int8_codec.scale_counts(g.layers, g.kv_heads, g.head_dim, g.page_tokens)
    k_scale = payloads[:, : 2 * n_k].view(torch.float16).view(-1, g.layers, 1, g.kv_heads, g.head_dim)
    v_scale = (
        payloads[:, 2 * n_k : 2 * (n_k + n_v)].view(torch.float16).view(-1, g.layers, g.page_tokens, g.kv_heads, 1)
    )
    codes = payloads[:, 2 * (n_k + n_v) :].view(torch.int8).view(-1, *g.page_shape).float()
    values = torch.stack([codes[:, :, 0] * k_scale.float(), codes[:, :, 1] * v_scale.float()], dim=2)
    return values.clamp(-int8_codec.FP16_MAX, int8_codec.FP16_MAX).to(torch.float16)


def _int8_scale(amax: torch.Tensor) -> torch.Tensor:
    """max |x| / 127 rounded up to an FP16 value (0 for an all-zero block), as `int8._scale`: a
    positive FP16 value's next one up is its bit pattern plus one."""
    wanted = amax.float() / int8_codec.CODE_MAX
    scale = wanted.to(torch.float16)
    bumped = (scale.view(torch.int16) + 1).view(torch.float16)
    return torch.where(scale.float() < wanted, bumped, scale)


def _reciprocal(scale: torch.Tensor) -> torch.Tensor:
    """1 / scale in float32, 0 for an all-zero block's scale of 0 (its values are all 0)."""
    s = scale.float()
    return torch.where(s > 0, 1.0 / s, torch.zeros_like(s))


class DeviceCodec(NamedTuple):
    """How a CUDA engine codes one lossy encoding on its device."""

    encode: Callable[[torch.Tensor], torch.Tensor]  # FP16 pages -> payload rows, on the device
    refused: Callable[[np.ndarray, PageGeometry], bool]  # the host's check of those rows (inf, NaN)
    decode: Callable[[torch.Tensor, PageGeometry], torch.Tensor]  # payload rows -> FP16 pages


DEVICE_CODECS = {
    FP8_E4M3: DeviceCodec(fp8_payloads, fp8_refused, fp8_decoded),
    INT8: DeviceCodec(int8_payloads, int8_refused, int8_decoded),
}


def _pow2(e: torch.Tensor) -> torch.Tensor:
    """2**e as float32, exactly, for integer e in -126..127: built from the exponent's bits, since
    torch.exp2's exactness on a device is not documented."""
    return ((e.to(torch.int32) + 127) << 23).view(torch.float32)


class _FP16KVLayer(DynamicLayer):
    """One layer's KV in a preallocated buffer that grows by doubling.

    Values are rounded through FP16 on the way in, so the cache holds exactly what a page holds.
    `keys`/`values` are views of the first `length` positions.
    """

    def __init__(self, kv_heads: int, head_dim: int, capacity: int, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.device = device
        self._k = torch.zeros(1, kv_heads, max(capacity, 1), head_dim, dtype=dtype, device=device)
        self._v = torch.zeros_like(self._k)
        self.length = 0
        self.is_initialized = True
        self._views()

    def _views(self) -> None:
        self.keys = self._k[:, :, : self.length]
        self.values = self._v[:, :, : self.length]

    def reserve(self, length: int) -> None:
        capacity = self._k.shape[2]
        if length > capacity:
            new_capacity = max(length, 2 * capacity)
            for name in ("_k", "_v"):
                old = getattr(self, name)
                grown = old.new_zeros(old.shape[:2] + (new_capacity,) + old.shape[3:])
                grown[:, :, :capacity] = old
                setattr(self, name, grown)

    def write(self, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        end = start + k.shape[2]
        self.reserve(end)
        self._k[:, :, start:end] = k.to(torch.float16)
        self._v[:, :, start:end] = v.to(torch.float16)

    def update(self, key_states, value_states, *args, **kwargs):
        self.write(self.length, key_states, value_states)
        self.length += key_states.shape[2]
        self._views()
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length


class _Rows(Cache):
    """Several requests' caches as one batch for a decode step: row r's new K/V go into request
    r's own layer, and attention reads each row's own K/V (`_rows_attention`). So requests of any
    lengths step together with no padding and no copy of their caches; only the projections and
    MLPs (nearly all of a decode step's work) run batched. transformers' own continuous batching
    (a paged cache it allocates and fills from its own prefill) has no way in for imported KV."""

    def __init__(self, sessions: list[Cache]):
        super().__init__(layers=list(sessions[0].layers))  # what mask helpers inspect: plain full layers
        self.sessions = sessions

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        pairs = [
            s.layers[layer_idx].update(key_states[r : r + 1], value_states[r : r + 1])
            for r, s in enumerate(self.sessions)
        ]
        return [k for k, _ in pairs], [v for _, v in pairs]


def _rows_attention(module, query, key, value, attention_mask, **kwargs):
    """sdpa, row by row where the cache is `_Rows` (its keys come as one tensor per row)."""
    if isinstance(key, list):
        rows = [
            sdpa_attention_forward(module, query[r : r + 1], k, v, None, **kwargs)[0]
            for r, (k, v) in enumerate(zip(key, value))
        ]
        return torch.cat(rows), None
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


ROWS_ATTENTION = "tandem_rows"
AttentionInterface.register(ROWS_ATTENTION, _rows_attention)
AttentionMaskInterface.register(ROWS_ATTENTION, sdpa_mask)  # a single request's masks stay sdpa's


class TorchAdapter(InProcessEngine):
    name = "torch"

    def __init__(self, model_dir, context_length=None, *, device: str | None = None, **kwargs):
        """`device`: "cuda", "cuda:1", "cpu"…; default: CUDA when available, else CPU."""
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        super().__init__(model_dir, context_length, **kwargs)

    def _load(self) -> None:
        hf_logging.disable_progress_bar()
        self.cuda = self.device.type == "cuda"
        self.dtype = torch.float16 if self.cuda else torch.float32
        self.export_lag = 1 if self.cuda else 0  # see InProcessEngine.export_start
        # lossy pages are decoded on the GPU (import_coded)
        self.decodes_coded = frozenset(DEVICE_CODECS) if self.cuda else frozenset()
        if self.cuda:
            # A small model on a big GPU is bound by the host queueing kernels: a cost per chunk,
            # not per token. Bigger chunks cut it (bench/gpu_prefill_export.py --chunks); pages still
            # leave chunk by chunk and the last page still computes on its own.
            self.prefill_chunk_tokens = CUDA_PREFILL_CHUNK_TOKENS
        # local_files_only: Tandem never downloads weights at run time; safetensors only: a pickled
        # checkpoint runs code when it loads
        model = AutoModelForCausalLM.from_pretrained(
            str(self.model_dir),
            dtype=self.dtype,
            local_files_only=True,
            use_safetensors=True,
            attn_implementation=ROWS_ATTENTION,
        )
        self.model = model.to(self.device).eval()

    def kv_budget_bytes(self) -> int:
        if self.cuda:  # half the device memory free once the weights are in (the cache is FP16)
            return self._executor.submit(lambda: torch.cuda.mem_get_info(self.device)[0] // 2).result()
        return super().kv_budget_bytes()

    def accelerator(self) -> dict:
        if self.device.type == "cuda":
            return {"kind": "cuda", "name": torch.cuda.get_device_name(self.device)}
        return super().accelerator()

    def new_session(self, capacity: int) -> Cache:
        g = self.geometry
        return Cache(
            layers=[_FP16KVLayer(g.kv_heads, g.head_dim, capacity, self.dtype, self.device) for _ in range(g.layers)]
        )

    @torch.inference_mode()
    def _run(self, session: Cache, token_ids: list[int]):
        ids = torch.tensor([token_ids], dtype=torch.long)
        # On CUDA the ids go up from pinned memory without a stream sync, so the host can queue
        # the next chunk while the device still computes this one.
        ids = ids.pin_memory().to(self.device, non_blocking=True) if self.cuda else ids
        return self.model(input_ids=ids, cache=session, use_cache=True, logits_to_keep=1)

    def forward(self, session: Cache, token_ids: list[int]) -> np.ndarray:
        return self._run(session, token_ids).logits[0, -1].float().cpu().numpy()

    @torch.inference_mode()
    def forward_rows(self, sessions: list[Cache], tokens: list[int]) -> np.ndarray:
        if len(sessions) == 1:  # alone, a request computes exactly as it always has
            return self.forward(sessions[0], tokens)[None]
        ids = torch.tensor([[t] for t in tokens], dtype=torch.long, device=self.device)
        positions = torch.tensor([[s.layers[0].length] for s in sessions], dtype=torch.long, device=self.device)
        # a 4D mask is taken as given (and `_rows_attention` needs none): no mask is built
        no_mask = torch.empty(len(sessions), 1, 1, 0, device=self.device)
        out = self.model(
            input_ids=ids,
            position_ids=positions,
            attention_mask=no_mask,
            cache=_Rows(sessions),
            use_cache=True,
            logits_to_keep=1,
        )
        return out.logits[:, -1].float().cpu().numpy()

    def forward_chunk(self, session: Cache, token_ids: list[int]) -> None:
        self._run(session, token_ids)  # on CUDA: queued, not waited for

    @staticmethod
    def _gather(session: Cache, start: int, end: int) -> torch.Tensor:
        """Positions [start, end) of every layer's K and V, in one kernel: [layers * 2][heads][n][dim]."""
        return torch.stack([t[0, :, start:end] for layer in session.layers for t in (layer._k, layer._v)])

    def export_kv(self, session: Cache, start: int, end: int) -> np.ndarray:
        # -> [layers][2][n][heads][dim] in FP16
        g = self.geometry
        kv = self._gather(session, start, end).view(g.layers, 2, g.kv_heads, end - start, g.head_dim)
        return kv.permute(0, 1, 3, 2, 4).to(torch.float16).contiguous().cpu().numpy()

    def export_start(self, session: Cache, start: int, end: int, lossy: int | None = None):
        if not self.cuda:
            return super().export_start(session, start, end)
        # On the device: whole pages, page-major and zero-padded, so that each page is one
        # contiguous slice of the host copy and no page is copied again on the host.
        g, n = self.geometry, end - start
        pages = -(-n // g.page_tokens)
        kv = torch.zeros(
            g.layers * 2, g.kv_heads, pages * g.page_tokens, g.head_dim, dtype=torch.float16, device=self.device
        )
        kv[:, :, :n] = self._gather(session, start, end)
        kv = kv.view(g.layers, 2, g.kv_heads, pages, g.page_tokens, g.head_dim).permute(3, 0, 1, 4, 2, 5).contiguous()
        host = torch.empty(kv.shape, dtype=torch.float16, pin_memory=True)  # torch's caching host allocator
        host.copy_(kv, non_blocking=True)  # queued behind this chunk's compute on the same stream
        codes = None
        if lossy is not None:  # encoded on the device, in the queue behind the copy: half the bytes come over
            coded = DEVICE_CODECS[lossy].encode(kv)
            codes = torch.empty(coded.shape, dtype=torch.uint8, pin_memory=True)
            codes.copy_(coded, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()
        return start, n, host, (lossy, codes), copied

    def export_finish(self, handle) -> list[KVPage]:
        if not self.cuda:
            return super().export_finish(handle)
        start, n, host, (lossy, codes), copied = handle
        copied.synchronize()
        P, data = self.geometry.page_tokens, host.numpy()  # the pages keep the pinned buffers alive
        coded = [None] * len(data)
        if codes is not None:
            coded = codes.numpy()
            if DEVICE_CODECS[lossy].refused(coded, self.geometry):
                raise ValueError(f"a page with infinities or NaN cannot be sent as {LOSSY[lossy].NAME}")
        return [
            KVPage(
                start // P + i,
                min(P, n - i * P),
                data[i],
                coded=coded[i],
                encoding=lossy,
            )
            for i in range(len(data))
        ]

    def import_kv(self, session: Cache, start: int, kv: np.ndarray) -> None:
        self._write(session, start, self._to_device(np.ascontiguousarray(kv)))

    def import_coded(self, session: Cache, start: int, payload: np.ndarray, n: int, encoding: int) -> None:
        # half the bytes cross to the device, and the host's codec (~15-30 ms a core for an 8B
        # model's page) is not in the stream's way
        decoded = DEVICE_CODECS[encoding].decode(self._to_device(payload)[None], self.geometry)
        self._write(session, start, decoded[0, :, :, :n])

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        with warnings.catch_warnings():
            # Received pages are read-only views of the wire buffer; we only read from them.
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            return torch.from_numpy(array).to(self.device)

    def _write(self, session: Cache, start: int, block: torch.Tensor) -> None:
        """Tokens [start, start + n) of every layer from `block` [layers][2][n][kv_heads][head_dim]."""
        block = block.permute(0, 1, 3, 2, 4).unsqueeze(2)  # [L][2][1][H][n][D]
        for layer, layer_kv in zip(session.layers, block):
            layer.write(start, layer_kv[0], layer_kv[1])

    def set_length(self, session: Cache, length: int) -> None:
        for layer in session.layers:
            layer.length = length
            layer._views()
