"""Parameter count and training FLOPs of FLUX.1, computed from the args alone (no model)."""

from titan_tpu.models.flux.args import FluxArgs


def _linear(fan_in: int, fan_out: int) -> int:
    return fan_in * fan_out + fan_out


def flux_param_count(args: FluxArgs) -> int:
    """Trainable parameters of FluxModel (and of diffusers' FluxTransformer2DModel of that shape)."""
    dim, hidden, head = args.dim, args.mlp_hidden_dim, args.head_dim
    stream = 3 * _linear(dim, dim) + 2 * head + _linear(dim, dim) + _linear(dim, hidden) + _linear(hidden, dim)
    double = 2 * (_linear(dim, 6 * dim) + stream)
    single = (
        _linear(dim, 3 * dim) + 3 * _linear(dim, dim) + 2 * head + _linear(dim, hidden) + _linear(dim + hidden, dim)
    )
    time = _linear(args.time_freq_dim, dim) + _linear(dim, dim)
    embedders = (
        _linear(args.in_channels, dim)
        + _linear(args.context_dim, dim)
        + time * (2 if args.guidance_embed else 1)
        + _linear(args.pooled_dim, dim)
        + _linear(dim, dim)
    )
    final = _linear(dim, 2 * dim) + _linear(dim, args.out_channels)
    return embedders + args.depth_double * double + args.depth_single * single + final


def flux_training_flops_per_sample(args: FluxArgs, image_tokens: int, text_tokens: int) -> float:
    """Training (forward + backward) FLOPs of one image-text sample.

    Convention (the 6N rule of the decoder families, counted per stream because FLUX's weights are):

    - Every weight W [out, in] of a Linear costs 2 * in * out FLOPs per row it is applied to in
      forward, and twice that in backward (gradients of input and weight): 6 * in * out per row.
      Rows are: image tokens (img_in, the image stream of the double blocks, the single blocks, the
      final projection), text tokens (txt_in, the text stream, the single blocks), and one per sample
      (the timestep, guidance and pooled-text embedders and every modulation Linear).
    - Attention's two matmuls (q k^T and p v) over the joint sequence L = image + text tokens cost
      2 * 2 * L^2 * dim per block forward, times 3 for training; nothing is masked.
    - Biases and elementwise work (norms, modulation, GELU, rotary, softmax) are ignored; the
      sinusoidal timestep features are not a matmul. Rematerialisation from activation checkpointing is
      overhead, not useful work, and is not counted.

    This equals torch.utils.flop_counter's count of a forward + backward with inputs that require grad
    (tests/unit/models/flux/test_model.py).
    """
    dim, hidden = args.dim, args.mlp_hidden_dim
    stream_per_token = 4 * dim * dim + 2 * dim * hidden  # q, k, v, attention out, MLP in + out
    single_per_token = 3 * dim * dim + dim * hidden + (dim + hidden) * dim
    image_macs = (
        args.in_channels * dim
        + args.depth_double * stream_per_token
        + args.depth_single * single_per_token
        + dim * args.out_channels
    )
    text_macs = args.context_dim * dim + args.depth_double * stream_per_token + args.depth_single * single_per_token
    time_macs = args.time_freq_dim * dim + dim * dim
    sample_macs = (
        time_macs * (2 if args.guidance_embed else 1)
        + args.pooled_dim * dim
        + dim * dim
        + args.depth_double * 2 * 6 * dim * dim
        + args.depth_single * 3 * dim * dim
        + 2 * dim * dim
    )
    weights = 2.0 * (image_tokens * image_macs + text_tokens * text_macs + sample_macs)
    joint = image_tokens + text_tokens
    attention = 4.0 * joint * joint * dim * (args.depth_double + args.depth_single)
    return 3.0 * (weights + attention)


def flux_flops_per_token(args: FluxArgs, seq_len: int) -> float:
    """ModelSpec's per-token form: training FLOPs per image token of a sample of `seq_len` image
    tokens and no text tokens. The rectified-flow task reports per sample with its real text length
    (`flux_training_flops_per_sample`)."""
    return flux_training_flops_per_sample(args, seq_len, 0) / seq_len
