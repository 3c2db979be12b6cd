"""FLUX.1 transformer hyperparameters and the published sizes (flavors)."""

from dataclasses import dataclass


@dataclass(frozen=True)
class FluxArgs:
    """Shape of a FLUX.1 flow transformer. Frozen: flavors are shared, derive with dataclasses.replace.

    in_channels is per image token: the autoencoder's latent channels times patch_size**2 (FLUX.1
    packs 2x2 patches of a 16-channel latent into 64). context_dim is the width of the per-token text
    embeddings (T5), pooled_dim the width of the pooled text vector (CLIP). The rotary embedding splits
    each head into axes_dim parts, one per position axis (text index, image row, image column), so the
    parts must add up to the head width.
    """

    in_channels: int = 64
    dim: int = 3072
    n_heads: int = 24
    depth_double: int = 19
    depth_single: int = 38
    mlp_ratio: float = 4.0
    context_dim: int = 4096
    pooled_dim: int = 768
    axes_dim: tuple[int, int, int] = (16, 56, 56)
    rope_theta: float = 10000.0
    guidance_embed: bool = False
    # Width of the sinusoidal features the timestep and guidance embedders start from.
    time_freq_dim: int = 256

    def __post_init__(self) -> None:
        if self.dim % self.n_heads != 0:
            raise ValueError(f"dim ({self.dim}) must be divisible by n_heads ({self.n_heads})")
        if sum(self.axes_dim) != self.head_dim:
            raise ValueError(f"axes_dim {self.axes_dim} must add up to the head width dim / n_heads = {self.head_dim}")
        if any(d % 2 for d in self.axes_dim):
            raise ValueError(f"every entry of axes_dim must be even for rotary embeddings, got {self.axes_dim}")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def mlp_hidden_dim(self) -> int:
        return int(self.dim * self.mlp_ratio)

    @property
    def out_channels(self) -> int:
        return self.in_channels


FLUX_FLAVORS: dict[str, FluxArgs] = {
    # Trains on a 2-core CPU in minutes: 3-channel latents (RGB pixels, or a tiny autoencoder's)
    # packed in 2x2 patches into 12 channels per token, tiny text encoders.
    "debug": FluxArgs(
        in_channels=12,
        dim=128,
        n_heads=4,
        depth_double=2,
        depth_single=2,
        context_dim=64,
        pooled_dim=32,
        axes_dim=(8, 12, 12),
    ),
    # The timestep-distilled model: no guidance embedding.
    "flux-schnell": FluxArgs(guidance_embed=False),
    # The guidance-distilled model: the guidance scale is an input, embedded like the timestep.
    "flux-dev": FluxArgs(guidance_embed=True),
}
