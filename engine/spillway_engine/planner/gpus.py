"""GPU catalogue: which kernels vLLM 0.33.0 picks on each GPU, and their block-size rules.

Tokens per block are not a model fact: vLLM asks the attention backends it selected
for the GPU which kernel block sizes they run (``get_supported_kernel_block_sizes``)
and, for Mamba/GDN hybrids, also aligns blocks to the GDN prefill kernel's checkpoint
grid. This module records those choices for the GPUs Spillway models; every rule
names the vLLM file it comes from so it can be re-checked when vLLM is bumped.

Modelled (vLLM 0.33.0, CUDA, default settings):

* Hopper (SM90: H100, H200)
  - attention: ``FLASH_ATTN`` (FA3), kernel blocks ``MultipleOf(16)``; multimodal
    prefix-LM models (Gemma 3 with a vision tower) get the ``TRITON_FLASH_ATTN``
    composite, also ``MultipleOf(16)`` (platforms/cuda.py ``_get_backend_priorities``).
    With an FP8 cache, head-512 layers run FA4 with exactly 64-token pages, and a
    model whose largest head is 512 prefers 64-token blocks (Gemma 4).
  - MLA: ``FLASH_ATTN_MLA`` ``MultipleOf(16)`` for 16-bit KV; it has no FP8 KV, so an
    FP8 KV cache falls through to ``FLASHMLA`` with fixed 64-token kernel blocks (or to
    ``TRITON_MLA`` when a forced ``--block-size`` is not a multiple of 64).
  - GDN prefill: FlashInfer (``_resolve_gdn_prefill_backend``: SM90 always), whose
    align-mode checkpoints need blocks on a 64-token grid
    (``FLASHINFER_GDN_CHECKPOINT_ALIGNMENT``).
* Ampere / Ada (SM80 A100, SM89 L40S)
  - attention: ``FLASH_ATTN`` (FA2) ``MultipleOf(16)``; an FP8 KV cache falls back to
    FlashInfer, attention sinks to Triton (FlashInfer's sinks need TRT-LLM's kernels),
    both 16-token blocks.
  - MLA: ``FLASH_ATTN_MLA``/``FLASHMLA``/``FLASHINFER_MLA`` need SM90+, so ``TRITON_MLA``,
    ``MultipleOf(16)``.
  - GDN prefill: Triton/FLA, no checkpoint grid.

* Blackwell (SM100, SM103, SM120): see the README's table.

Sparse MLA's backends (every GPU) are chosen in ``sparse_mla.py``.

Which ``--kv-cache-dtype`` values any backend of these lists stores is in
``attention_backend.py`` (a dtype none of them takes is refused as vLLM refuses it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from spillway_engine.planner.shape import UnsupportedModel

GdnKernel = Literal["flashinfer", "triton"]


@dataclass(frozen=True)
class KernelBlocks:
    """A backend's kernel block sizes: ``MultipleOf(base)`` or a fixed ``base``.

    Either way a manager block may be any multiple of the smallest kernel block
    (``AttentionBackend.supports_block_size``: larger blocks split into kernel blocks);
    ``fixed`` only changes which size the backend prefers.
    """

    base: int
    fixed: bool = False

    def accepts(self, block_size: int) -> bool:
        return block_size % self.base == 0

    def preferred(self, default: int = 16) -> int:
        """``AttentionBackend.get_preferred_block_size``: the default if accepted, else base."""
        return default if self.accepts(default) else self.base


@dataclass(frozen=True)
class Backend:
    name: str
    blocks: KernelBlocks


FLASH_ATTN = Backend("FLASH_ATTN", KernelBlocks(16))
TRITON_FLASH_ATTN = Backend("TRITON_FLASH_ATTN", KernelBlocks(16))
FLASHINFER = Backend("FLASHINFER", KernelBlocks(16))
#: Blackwell (SM10x) for multimodal prefix-LM models: Triton for the image masks beside
#: FlashInfer, whose composite runs exactly 64-token kernel pages (triton_flashinfer.py)
TRITON_FLASHINFER = Backend("TRITON_FLASHINFER", KernelBlocks(64, fixed=True))
TRITON_ATTN = Backend("TRITON_ATTN", KernelBlocks(16))
#: FlashInfer's MLA (TRT-LLM gen kernels, SM10x): kernel pages of 32 or 64 tokens, so
#: 16 is not accepted and 32 is preferred (flashinfer_mla.py)
FLASHINFER_MLA = Backend("FLASHINFER_MLA", KernelBlocks(32))
FLASH_ATTN_MLA = Backend("FLASH_ATTN_MLA", KernelBlocks(16))
FLASHMLA = Backend("FLASHMLA", KernelBlocks(64, fixed=True))
TRITON_MLA = Backend("TRITON_MLA", KernelBlocks(16))
# Sparse MLA (DeepSeek sparse attention) on SM90: the first of FLASH_ATTN_MLA_SPARSE,
# FLASHMLA_SPARSE, FLASHINFER_MLA_SPARSE_SM90 that takes the KV dtype; each runs
# MultipleOf(64) kernel blocks (v1/attention/backends/mla/*sparse*.py).
FLASH_ATTN_MLA_SPARSE = Backend("FLASH_ATTN_MLA_SPARSE", KernelBlocks(64))
FLASHMLA_SPARSE = Backend("FLASHMLA_SPARSE", KernelBlocks(64))
#: FlashInfer's SM90 sparse MLA (flashinfer_mla_sparse_sm90.py): plain fp8/fp8_e4m3
#: latents (one byte an element, a per-tensor scale) or 16-bit ones, flat rows
#: (align_blocks_to_rows), MultipleOf(64); first of the sparse list at head 512 when
#: FlashInfer's kernels are usable (has_flashinfer_sm90_nope_mla)
FLASHINFER_MLA_SPARSE_SM90 = Backend("FLASHINFER_MLA_SPARSE_SM90", KernelBlocks(64))
#: FlashAttention on SM90 for a model whose largest head is 512 with an FP8 cache: FA3
#: stops at head 256, so the head-512 layers run FA4, whose FP8-dequant kernel takes
#: exactly 64-token pages; the model's (largest) head sets the preferred block to 64
#: (flash_attn.py ``_get_sm90_fa4_fp8_kv_block_size``; Gemma4Config leaves FA3/FA4 to
#: each layer then). The smaller-head layers keep FA3's MultipleOf(16).
FLASH_ATTN_SM90_FP8_HD512 = Backend("FLASH_ATTN", KernelBlocks(64, fixed=True))
#: FLASHMLA_SPARSE serves an fp8 KV cache as fp8_ds_mla: 512 fp8 NoPE + 16 B scales +
#: 64 bf16 RoPE = 656 B a token (MLAAttention.get_kv_cache_spec, state_content_bytes)
FP8_DS_MLA_BYTES_PER_TOKEN = 656

#: DeepSeek-V4 on SM90: FlashMLA's V4 kernels (models/deepseek_v4/sparse_mla.py
#: ``DeepseekV4FlashMLABackend``), exactly 256-token kernel pages; its indexer's backend
#: has the same 256 and the sliding-window cache MultipleOf(32), so 256 is the block
FLASHMLA_SPARSE_DSV4 = Backend("FLASHMLA_SPARSE_DSV4", KernelBlocks(256, fixed=True))
#: DeepSeek-V4 on SM12x (``DeepseekV4FlashInferSM120Attention``): FlashInfer's kernels on
#: the same fp8_ds_mla layout, exactly 256-token kernel pages
FLASHINFER_MLA_SPARSE_DSV4 = Backend("FLASHINFER_MLA_SPARSE_DSV4", KernelBlocks(256, fixed=True))
#: FlashMLA's V4 cache rows (fp8_ds_mla): 448 fp8 NoPE + 64 bf16 RoPE + 8 B of UE8M0
#: scales = 584 B a token (``state_content_bytes``), pages rounded up to 576 B
DSV4_FP8_DS_MLA_BYTES_PER_TOKEN = 584
DSV4_FP8_DS_MLA_PAGE_ALIGNMENT = 576

#: FlashInfer GDN prefill checkpoint grid (vllm/v1/attention/backends/gdn_attn.py).
FLASHINFER_GDN_CHECKPOINT_ALIGNMENT = 64

_FP8_KV = ("fp8", "fp8_e4m3", "fp8_e5m2")

#: head sizes of FlashInfer's attention (flashinfer.py ``get_supported_head_sizes``), of
#: the prefix-LM composites (triton_flash_attn.py, triton_flashinfer.py), of FlashInfer's
#: MLA (latent + RoPE), and those FA4 runs on Blackwell (fa_utils: not 192 or 512, TMEM)
_FLASHINFER_HEADS = (64, 128, 256, 512)
_COMPOSITE_HEADS = (256, 512)
_FLASHINFER_MLA_HEADS = (320, 512, 576)
_FA4_BLACKWELL_HEADS = (64, 80, 96, 128)

#: CUDA runtime of vLLM 0.33.0's CUDA image and PyPI wheel (torch 2.14.0+cu13x); a CUDA 12
#: build changes Blackwell's GDN prefill kernel, so it is an input of the plan
DEFAULT_CUDA_MAJOR = 13


@dataclass(frozen=True)
class Gpu:
    """One GPU model as vLLM 0.33.0 sees it."""

    name: str
    product: str
    generation: Literal["ampere", "ada", "hopper", "blackwell"]
    compute_capability: tuple[int, int]
    memory_bytes: int
    #: host <-> GPU bytes a second, per direction, theoretical
    host_link_bytes_per_s: float
    #: GPU Feature Discovery's ``nvidia.com/gpu.product`` values naming this GPU
    gfd_products: tuple[str, ...]

    @property
    def blackwell(self) -> bool:
        return self.generation == "blackwell"

    def attention_backend(
        self, *, mm_prefix: bool, kv_cache_dtype: str, sinks: bool, head_size: int = 128
    ) -> Backend:
        """The non-MLA attention backend vLLM selects: the first of its priority list for
        the GPU's capability (platforms/cuda.py ``_get_backend_priorities``) whose
        ``validate_configuration`` takes the model (head size, prefix-LM masks, sinks,
        an FP8 cache). Every candidate but TRITON_FLASHINFER runs 16-token kernel blocks.
        """
        major = self.compute_capability[0]
        # FlashAttention (and its prefix-LM composite) stores no fp8_e5m2 cache; FlashInfer
        # and Triton do (each backend's supported_kv_cache_dtypes)
        fa = kv_cache_dtype != "fp8_e5m2"
        if major == 9:
            if mm_prefix:
                # the Triton+FlashAttention composite takes heads 256 and 512 only; FA3 has
                # no prefix-LM path and FA4 none at the other heads; FlashInfer has none
                composite = fa and head_size in _COMPOSITE_HEADS
                return TRITON_FLASH_ATTN if composite else TRITON_ATTN
            if fa:
                return FLASH_ATTN
            return FLASHINFER if head_size in _FLASHINFER_HEADS else TRITON_ATTN
        if major == 10:
            # SM10x lists FlashInfer (TRT-LLM kernels: sinks, FP8) first, after the
            # Triton+FlashInfer composite for prefix-LM models; FlashAttention (FA4) serves
            # the heads FlashInfer lacks, and prefix-LM masks up to head 128
            fa4 = FLASH_ATTN if fa else TRITON_ATTN
            if mm_prefix:
                if head_size in _COMPOSITE_HEADS:
                    return TRITON_FLASHINFER
                return fa4 if head_size in _FA4_BLACKWELL_HEADS else TRITON_ATTN
            return FLASHINFER if head_size in _FLASHINFER_HEADS else fa4
        if mm_prefix:
            # FlashAttention's prefix-LM path needs FA4 (not on SM8x/SM12x), FlashInfer
            # has none: Triton, the next in the list
            return TRITON_ATTN
        # FA2 (SM8x, and SM12x where FA3/FA4 do not run) stops at head 256 and has
        # neither sinks nor an FP8 KV cache; FlashInfer, next in the list, takes those,
        # but sinks only through TRT-LLM's kernels (SM90, SM10x, SM12x:
        # ``FlashInferBackend.supports_sink``), so sinks on SM8x go on to Triton.
        if sinks and major == 8:
            return TRITON_ATTN
        if sinks or kv_cache_dtype in _FP8_KV or head_size > 256:
            return FLASHINFER if head_size in _FLASHINFER_HEADS else TRITON_ATTN
        return FLASH_ATTN

    def mla_backend(
        self, *, kv_cache_dtype: str, block_size: int | None = None, head_size: int = 576
    ) -> Backend:
        """The MLA backend: the first in vLLM's SM90 order that takes the dtype and a
        forced ``--block-size`` (the selector passes user block sizes)."""
        major = self.compute_capability[0]
        if major == 10:
            # FLASHINFER_MLA first on SM10x, for 16-bit and FP8 latents; a forced block it
            # does not take falls past TOKENSPEED/CUTLASS (R1 FP8 only / 128-token pages),
            # FlashAttention's and FlashMLA's dense MLA (SM90 only) to Triton
            if head_size in _FLASHINFER_MLA_HEADS and (
                block_size is None or FLASHINFER_MLA.blocks.accepts(block_size)
            ):
                return FLASHINFER_MLA
            return TRITON_MLA
        if major != 9:
            return TRITON_MLA
        if kv_cache_dtype not in _FP8_KV:
            return FLASH_ATTN_MLA
        if block_size is None or FLASHMLA.blocks.accepts(block_size):
            return FLASHMLA
        return TRITON_MLA

    def compressed_sparse_mla_backend(self, *, kv_cache_dtype: str) -> Backend:
        """DeepSeek-V4's attention backend (models/deepseek_v4/nvidia/model.py
        ``_select_dsv4_attn_cls``: FlashMLA's V4 kernels, FlashInfer's on SM12x; SM10x
        keeps FlashMLA's unless --attention-backend asks otherwise)."""
        if self.compute_capability[0] not in (9, 10, 12):
            # FlashMLA's V4 kernels are SM90/SM100 only; vLLM does not ask the selector
            # for these layers, so it fails on the GPU rather than at start-up.
            raise UnsupportedModel(
                f"DeepSeek-V4 on {self.name} (SM{self.compute_capability[0]}"
                f"{self.compute_capability[1]}): vLLM 0.33.0 runs it on FlashMLA's V4 "
                "sparse kernels (FLASHMLA_SPARSE_DSV4: supports_compute_capability is "
                "9.x and 10.x only), which do not run here"
            )
        if kv_cache_dtype != "auto" and not kv_cache_dtype.startswith("fp8"):
            raise UnsupportedModel(
                f"DeepSeek-V4 with kv-cache dtype {kv_cache_dtype!r}: vLLM 0.33.0 refuses it "
                "(DeepseekV4 fp8_ds_mla layout only supports fp8 kv-cache); its V4 "
                "kernels store every cache as fp8_ds_mla, so use auto or fp8"
            )
        # SM12x: FlashInfer's SM120 V4 class, the same fp8_ds_mla rows and 256-token pages
        if self.compute_capability[0] == 12:
            return FLASHINFER_MLA_SPARSE_DSV4
        return FLASHMLA_SPARSE_DSV4

    def gdn_prefill_kernel(self, head_k_dim: int = 128, cuda_major: int = DEFAULT_CUDA_MAJOR
                           ) -> GdnKernel:
        """GDN prefill kernel (``_resolve_gdn_prefill_backend``): FlashInfer's on SM90
        always, on SM10x/SM12x for 128-wide key heads with a CUDA 13 runtime; else Triton's."""
        major = self.compute_capability[0]
        if major == 9:
            return "flashinfer"
        if major in (10, 12) and head_k_dim == 128 and cuda_major >= 13:
            return "flashinfer"
        return "triton"


def gdn_checkpoint_alignment(kernel: GdnKernel | None) -> int | None:
    """Token grid align-mode GDN blocks must sit on, or None (no constraint)."""
    return FLASHINFER_GDN_CHECKPOINT_ALIGNMENT if kernel == "flashinfer" else None


_GIB = 2**30
_GB = 10**9

# Host link per direction: PCIe Gen4 x16 32 GB/s and Gen5 x16 63 GB/s theoretical
# (16 GT/s and 32 GT/s a lane x 16 lanes x 128b/130b); Grace superchips reach their GPU
# over NVLink-C2C, 900 GB/s both ways (450 a direction).
PCIE_GEN4_X16 = 16 * 16 * (128 / 130) / 8 * _GB
PCIE_GEN5_X16 = 32 * 16 * (128 / 130) / 8 * _GB
NVLINK_C2C = 450 * _GB


def _gpu(name, product, generation, cc, memory_gib, link, gfd_products) -> Gpu:
    return Gpu(name, product, generation, cc, int(memory_gib * _GIB), link, tuple(gfd_products))


#: Every GPU Spillway plans for. ``gfd_products`` are GPU Feature Discovery's
#: ``nvidia.com/gpu.product`` values for it (nvidia-smi's name, spaces as dashes);
#: ``memory_bytes`` what the driver reports as usable; the host link per direction.
GPUS: dict[str, Gpu] = {
    gpu.name: gpu
    for gpu in (
        _gpu("h100", "NVIDIA H100 80GB HBM3", "hopper", (9, 0), 80, PCIE_GEN5_X16,
             ["NVIDIA-H100-80GB-HBM3", "NVIDIA-H100-SXM5-80GB", "NVIDIA-H100-PCIe",
              "NVIDIA-H100-NVL"]),
        _gpu("h200", "NVIDIA H200 141GB HBM3e", "hopper", (9, 0), 141, PCIE_GEN5_X16,
             ["NVIDIA-H200", "NVIDIA-H200-141GB-HBM3e", "NVIDIA-H200-NVL"]),
        _gpu("h20", "NVIDIA H20 96GB HBM3", "hopper", (9, 0), 96, PCIE_GEN5_X16,
             ["NVIDIA-H20"]),
        _gpu("a100", "NVIDIA A100 80GB", "ampere", (8, 0), 80, PCIE_GEN4_X16,
             ["NVIDIA-A100-SXM4-80GB", "NVIDIA-A100-80GB-PCIe"]),
        _gpu("a100-40gb", "NVIDIA A100 40GB", "ampere", (8, 0), 40, PCIE_GEN4_X16,
             ["NVIDIA-A100-SXM4-40GB", "NVIDIA-A100-PCIE-40GB"]),
        _gpu("l40s", "NVIDIA L40S 48GB", "ada", (8, 9), 48, PCIE_GEN4_X16, ["NVIDIA-L40S"]),
        _gpu("l4", "NVIDIA L4 24GB", "ada", (8, 9), 24, PCIE_GEN4_X16, ["NVIDIA-L4"]),
        _gpu("b200", "NVIDIA B200 180GB HBM3e", "blackwell", (10, 0), 179, PCIE_GEN5_X16,
             ["NVIDIA-B200"]),
        _gpu("gb200", "NVIDIA GB200 186GB HBM3e (Grace Blackwell)", "blackwell", (10, 0),
             184, NVLINK_C2C, ["NVIDIA-GB200"]),
        _gpu("b300", "NVIDIA B300 288GB HBM3e (Blackwell Ultra)", "blackwell", (10, 3), 268,
             PCIE_GEN5_X16, ["NVIDIA-B300-SXM6-AC", "NVIDIA-B300"]),
        _gpu("gb300", "NVIDIA GB300 288GB HBM3e (Grace Blackwell Ultra)", "blackwell", (10, 3),
             268, NVLINK_C2C, ["NVIDIA-GB300"]),
        _gpu("rtx-pro-6000", "NVIDIA RTX PRO 6000 Blackwell 96GB GDDR7", "blackwell", (12, 0),
             95, PCIE_GEN5_X16,
             ["NVIDIA-RTX-PRO-6000-Blackwell-Server-Edition",
              "NVIDIA-RTX-PRO-6000-Blackwell-Workstation-Edition",
              "NVIDIA-RTX-PRO-6000-Blackwell-Max-Q-Workstation-Edition"]),
    )
}

_ALIASES = {
    "hopper": "h100",
    "h100-80gb": "h100",
    "h100-sxm": "h100",
    "h100-pcie": "h100",
    "h200-141gb": "h200",
    "a100-80gb": "a100",
    "ampere": "a100",
    "blackwell": "b200",
    "rtx-pro-6000-blackwell": "rtx-pro-6000",
    "rtxpro6000": "rtx-pro-6000",
}

DEFAULT_GPU = "h100"


class UnknownGpu(ValueError):
    pass


def get_gpu(name: str) -> Gpu:
    """The catalogue entry for ``name`` (case-insensitive; ``H100``, ``b200``, ``RTX-PRO-6000``,
    or a GFD product label such as ``NVIDIA-H100-80GB-HBM3``)."""
    key = name.strip().lower().replace("_", "-").replace(" ", "-")
    by_label = gpu_for_product_label(name)
    if by_label is not None:
        return by_label
    key = key.removeprefix("nvidia-")
    key = _ALIASES.get(key, key)
    if key in GPUS:
        return GPUS[key]
    raise UnknownGpu(f"unknown GPU {name!r}; known GPUs: {', '.join(GPUS)}")


def gpu_for_product_label(label: str) -> Gpu | None:
    """The catalogue GPU GFD's ``nvidia.com/gpu.product`` value names, or None."""
    wanted = label.strip().lower()
    for gpu in GPUS.values():
        if any(p.lower() == wanted for p in gpu.gfd_products):
            return gpu
    return None
