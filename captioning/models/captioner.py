"""Captioner = CNN encoder + attention LSTM decoder, with `forward` and `generate`.

`CaptionerConfig` (YAML `model.net`) rebuilds the network; `DecodeConfig` (YAML `model.decode`)
says how captions are decoded. Both are stored as plain dicts in checkpoints.

`save_pretrained` / `from_pretrained` write and read a shareable model folder (safetensors
weights, JSON config and vocabulary, a model card; see `captioning.models.pretrained`).
"""

from __future__ import annotations

import logging
import numbers
import os
import warnings
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any, Literal, TypeVar

import torch
from torch import Tensor, nn

from captioning.choices import check_choice
from captioning.models.attention import (
    Anneal,
    GumbelSchedule,
    Normalizer,
    WeightRule,
    scorer_class,
)
from captioning.models.decoder import AttentionLSTMDecoder, DecoderOutput
from captioning.models.decoding import (
    Generation,
    SpecialIds,
    beam_search,
    greedy_search,
    sample_search,
)
from captioning.models.encoder import CNNEncoder, fingerprint
from captioning.models.fixed_beam import (
    BeamSettings,
    FastBeamSetting,
    FixedBeamSearch,
    resolve_fast_beam,
)
from captioning.models.initialise import capgen_init
from captioning.models.pretrained import (
    CONFIG_FILE,
    PretrainedError,
    model_card,
    read_model_folder,
    write_model_folder,
)
from captioning.models.repeats import per_distinct_row
from captioning.models.settings import (
    AttentionKind,
    HardEstimator,
    SemiSampling,
    SemiSamplingGrad,
    check_settings,
)
from captioning.models.state import grid_dtype
from captioning.vocab import Vocabulary

Strategy = Literal["greedy", "beam", "sample"]
WeightInit = Literal["torch", "capgen"]  # PyTorch's defaults, or the authors' (`initialise`)
log = logging.getLogger(__name__)

_Config = TypeVar("_Config", bound="_PlainConfig")


@dataclass(frozen=True)
class _PlainConfig:
    """A frozen dataclass that round-trips through a plain dict (checkpoints, JSON); a
    dataclass itself, so that jsonargparse parses its subclasses as plain nested options."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)  # type: ignore[call-overload]

    @classmethod
    def from_dict(cls: type[_Config], data: dict[str, Any]) -> _Config:
        if not isinstance(data, dict):
            raise ValueError(f"{cls.__name__} must be a dict, got {type(data).__name__}")
        known = {f.name for f in fields(cls)}  # type: ignore[arg-type]
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"{cls.__name__} has unknown fields {unknown}")
        return cls(**data)


def check_whole(group: str, config: Any, names: tuple[str, ...]) -> None:
    """Refuse a field of `config` among `names` that is not a whole number >= 1 (a float or a
    string from a hand-written dict would fail later, far from its cause)."""
    for name in names:
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise ValueError(f"{group}.{name} must be a whole number, got {value!r}")
        if value < 1:
            raise ValueError(f"{group}.{name} must be >= 1, got {value}")


@dataclass(frozen=True)
class DecodeConfig(_PlainConfig):
    """How captions are decoded: the one set of decoding settings (validation, test, the
    `caption` command, overlays). Hard-attention models also follow `net.hard_decode`."""

    strategy: Strategy = "beam"
    beam_size: int = 3
    max_len: int = 20
    length_penalty: float = 0.0  # rank finished beams by score / length^penalty
    forbid_unk: bool = False
    temperature: float = 1.0  # sample: draw words from softmax(logits / temperature)
    num_captions: int = 1  # captions per image: the n best beams (<= beam_size), or n samples

    def __post_init__(self) -> None:
        check_choice("decode.strategy", self.strategy, Strategy)
        check_whole("decode", self, ("beam_size", "max_len", "num_captions"))
        if self.length_penalty < 0:
            raise ValueError(f"decode.length_penalty must be >= 0, got {self.length_penalty}")
        if not self.temperature > 0:
            raise ValueError(f"decode.temperature must be > 0, got {self.temperature}")
        if self.strategy == "beam" and self.num_captions > self.beam_size:
            raise ValueError(f"decode.num_captions ({self.num_captions}) must be <= "
                             f"decode.beam_size ({self.beam_size})")
        if self.strategy == "greedy" and self.num_captions != 1:
            raise ValueError("decode.num_captions must be 1 with greedy search (use beam or "
                             f"sample), got {self.num_captions}")

    def beam_settings(self) -> BeamSettings:
        """What beam search reads of these settings (`beam_search`, `FixedBeamSearch`)."""
        return BeamSettings(self.beam_size, self.max_len, self.length_penalty, self.forbid_unk,
                            self.num_captions)


#: CaptionerConfig's fields that only hard attention reads, and those only its Gumbel estimator
#: reads (`CaptionerConfig.unused`); a new field of either kind is listed here.
HARD_ONLY = ("hard_decode", "semi_sampling_prob", "semi_sampling", "semi_sampling_grad",
             "hard_estimator")
GUMBEL_ONLY = ("gumbel_tau_start", "gumbel_tau_end", "gumbel_anneal", "gumbel_anneal_steps")


@dataclass(frozen=True)
class CaptionerConfig(_PlainConfig):
    """Everything needed to rebuild a Captioner; stored as a plain dict in checkpoints.

    A dict without the newer fields (an older checkpoint) reads with their defaults, which
    rebuild the same network: the additive score, one attention layer, one init layer.
    `hard_estimator: gumbel` trains hard attention with the straight-through Gumbel-softmax,
    its temperature annealed by the `gumbel_*` fields (0 steps: over the whole run).
    `semi_sampling_grad`: `paper` (the default, as capgen.py) or `detached` (α of semi-sampled
    captions gets no likelihood gradient). `n_layers_att` / `n_layers_init`: capgen.py's options
    (2 and 2 in the authors' COCO script, evaluate_coco.py).
    """

    vocab_size: int = 0
    backbone: str = "vgg19"
    weights: str | None = None
    grid_size: int | None = 14
    image_size: int = 224
    finetune_encoder: bool = False
    channels_last: bool = False
    embed_dim: int = 512
    hidden_dim: int = 512
    attn_dim: int = 512
    dropout: float = 0.5
    attention: AttentionKind = "soft"
    hard_decode: WeightRule = "expected"
    semi_sampling_prob: float = 0.5
    semi_sampling: SemiSampling = "image"
    semi_sampling_grad: SemiSamplingGrad = "paper"
    hard_estimator: HardEstimator = "reinforce"
    gumbel_tau_start: float = 1.0
    gumbel_tau_end: float = 0.5
    gumbel_anneal: Anneal = "exponential"
    gumbel_anneal_steps: int = 0
    score: str = "additive"  # a name in SCORERS, or a Scorer subclass's import path
    n_layers_att: int = 1
    n_layers_init: int = 1
    normalizer: Normalizer = "softmax"
    output_tanh: bool = False  # capgen.py's tanh on the deep output's sum (Eq. 7 has none)
    weight_init: WeightInit = "torch"  # `capgen`: the authors' (`models.initialise`)

    def __post_init__(self) -> None:
        """Refuse impossible values at construction, before any weights load (one line)."""
        check_whole("net", self, ("embed_dim", "hidden_dim", "attn_dim", "image_size",
                                  "n_layers_att", "n_layers_init"))
        check_choice("net.weight_init", self.weight_init, WeightInit)
        try:
            scorer_class(self.score)
        except ValueError as e:
            raise ValueError(f"net.{e}") from None
        if self.vocab_size < 0 or (self.grid_size is not None and self.grid_size < 1):
            raise ValueError(f"net.vocab_size must be >= 0 and net.grid_size >= 1 (or null), "
                             f"got {self.vocab_size} and {self.grid_size}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"net.dropout must be in [0, 1), got {self.dropout}")
        try:  # the decoder's own checks, in one place
            check_settings(attention=self.attention, hard_decode=self.hard_decode,
                           semi_sampling=self.semi_sampling,
                           semi_sampling_prob=self.semi_sampling_prob,
                           semi_sampling_grad=self.semi_sampling_grad,
                           hard_estimator=self.hard_estimator, n_layers_init=self.n_layers_init,
                           normalizer=self.normalizer)
        except ValueError as e:
            raise ValueError(f"net.{e}") from None
        if self.gumbel_anneal_steps < 0:
            raise ValueError(f"net.gumbel_anneal_steps must be >= 0, "
                             f"got {self.gumbel_anneal_steps}")
        self.gumbel_schedule()  # validates the temperatures

    def unused(self) -> list[str]:
        """The hard-attention fields set away from their defaults that this attention ignores:
        all of them with soft attention, the Gumbel ones with REINFORCE."""
        names = [*HARD_ONLY, *GUMBEL_ONLY]
        if self.attention == "hard":
            names = list(GUMBEL_ONLY) if self.hard_estimator == "reinforce" else []
        defaults = {f.name: f.default for f in fields(self)}
        return [f"net.{n} {getattr(self, n)!r}" for n in names if getattr(self, n) != defaults[n]]

    def gumbel_schedule(self) -> GumbelSchedule:
        """The Gumbel-softmax temperature schedule of these settings."""
        return GumbelSchedule(start=self.gumbel_tau_start, end=self.gumbel_tau_end,
                              anneal=self.gumbel_anneal, steps=self.gumbel_anneal_steps)


def check_input(x: Tensor, dim: int) -> None:
    """Refuse what is neither float images (B, 3, H, W) nor annotation grids (B, L, `dim`),
    naming the shape and the likely cause (no sync: shapes and dtypes only)."""
    if not isinstance(x, Tensor):
        raise TypeError(f"images must be a float tensor (B, 3, H, W), got {type(x).__name__}: "
                        "for image files or PIL images, pass captioning.data.transforms."
                        "model_inputs(images, model.config.image_size)")
    if not x.is_floating_point():
        raise TypeError(f"images must be a float tensor, normalised as "
                        f"captioning.data.transforms.build_image_transform makes them; got "
                        f"{x.dtype}")
    if (x.dim() == 3 and x.size(-1) == dim) or (x.dim() == 4 and x.size(1) == 3):
        return
    hint = "; one image needs a batch dimension (images[None])" if x.dim() == 3 else ""
    raise ValueError(f"expected images (B, 3, H, W) or annotation grids (B, L, {dim}), got "
                     f"shape {tuple(x.shape)}{hint}")


class Captioner(nn.Module):
    """Images (or cached annotation grids) in, captions and attention maps out."""

    #: Beam search over fixed shapes (`use_fast_beam`); None: `decoding.beam_search`.
    fast_beam: FixedBeamSearch | None
    fast_beam_setting: FastBeamSetting  # `auto` resolves by the grids' device

    def __init__(self, config: CaptionerConfig) -> None:
        super().__init__()
        if config.vocab_size <= len(SpecialIds.__dataclass_fields__):
            raise ValueError(f"vocab_size must exceed the 4 special tokens, got {config.vocab_size}")
        self.config = config
        self.encoder = CNNEncoder(
            backbone=config.backbone,
            weights=config.weights,
            grid_size=config.grid_size,
            trainable=config.finetune_encoder,
            channels_last=config.channels_last,
        )
        self.decoder = AttentionLSTMDecoder(
            vocab_size=config.vocab_size,
            feature_dim=self.encoder.dim,
            embed_dim=config.embed_dim,
            hidden_dim=config.hidden_dim,
            attn_dim=config.attn_dim,
            dropout=config.dropout,
            attention=config.attention,
            hard_decode=config.hard_decode,
            semi_sampling_prob=config.semi_sampling_prob,
            semi_sampling=config.semi_sampling,
            semi_sampling_grad=config.semi_sampling_grad,
            hard_estimator=config.hard_estimator,
            gumbel=config.gumbel_schedule(),
            score=config.score,
            n_layers_att=config.n_layers_att,
            n_layers_init=config.n_layers_init,
            normalizer=config.normalizer,
            output_tanh=config.output_tanh,
        )
        if config.weight_init == "capgen":
            capgen_init(self.decoder, embed_dim=config.embed_dim)
        unused = config.unused()
        if unused:
            log.warning("no effect with %s attention%s: %s", config.attention,
                        f" ({config.hard_estimator})" if config.attention == "hard" else "",
                        ", ".join(unused))
        native = self.encoder.spec.side(config.image_size)
        if config.grid_size and config.grid_size > native:
            log.warning("net.grid_size %d is finer than %s's %dx%d map at %d px: its %d locations "
                        "repeat at most %d distinct annotation vectors; for a native grid give "
                        "net.image_size %d px or more, or net.grid_size %d or less",
                        config.grid_size, config.backbone, native, native, config.image_size,
                        config.grid_size ** 2, native ** 2,
                        config.grid_size * self.encoder.spec.stride, native)
        #: The words of the token ids and the decoding settings to use: set by
        #: `from_pretrained` (a model built from a config has no vocabulary).
        self.vocab: Vocabulary | None = None
        self.decode: DecodeConfig = DecodeConfig()
        #: The loss settings of the run that trained it, where known (`from_pretrained`):
        #: `save_pretrained` keeps them.
        self.loss_settings: dict[str, Any] = {}
        #: The data source its run read and that source's carving rule, where known
        #: (`from_pretrained`): `save_pretrained` keeps them.
        self.trained_on: dict[str, Any] = {}
        self.use_fast_beam("auto")  # `fast_beam`, `fast_beam_setting`

    def use_fast_beam(self, runner: FastBeamSetting) -> None:
        """Beam search by `fixed_beam.FixedBeamSearch` (the same captions over fixed shapes:
        `fixed`, `compile`d, or replayed as CUDA `graphs`), by `beam_search` (`off`), or
        `auto`: `graphs` for grids on CUDA (unless the decoder samples its locations),
        `beam_search` elsewhere (`resolve_fast_beam`)."""
        check_choice("fast_beam", runner, FastBeamSetting)
        self.fast_beam_setting = runner
        self.fast_beam = None if runner == "off" else \
            FixedBeamSearch(self.decoder, "graphs" if runner == "auto" else runner)

    def beam_runner(self, device: torch.device) -> FixedBeamSearch | None:
        """The fixed-shape search that decodes grids on `device`; None: `beam_search`."""
        if self.fast_beam is None or resolve_fast_beam(
                self.fast_beam_setting, device, self.decoder.step_rule) == "off":
            return None
        return self.fast_beam

    @property
    def grid(self) -> tuple[int, int]:
        """(gh, gw) of the annotation grid."""
        return self.encoder.grid_shape(self.config.image_size)

    def encode(self, images: Tensor, *, keep_half: bool = False) -> Tensor:
        """(B, 3, H, W) images -> (B, L, D) annotations; (B, L, D) cached features pass through.

        Cached grids travel as float16 (half the bytes); compute starts from float32 here
        (`grid_dtype`). `keep_half`: they stay float16, for the teacher-forced pass
        (`AttentionLSTMDecoder.forward`), which reads them as the float32 values they hold.
        """
        check_input(images, self.encoder.dim)
        if images.dim() == 3:
            return images if keep_half else images.to(grid_dtype(images.dtype,
                                                                 self.decoder.weight_dtype))
        weights = self.decoder.weight_dtype  # the encoder's too, unless it was cast alone
        if images.is_floating_point() and images.dtype != weights and \
                not torch.is_autocast_enabled(images.device.type):
            images = images.to(weights)  # a model cast whole (bf16-true) given float32 images
        if self.encoder.trainable:
            return self.encoder(images)
        return per_distinct_row(images, self.encoder)  # frozen: once per distinct image

    def feature_cache_key(self) -> dict[str, Any]:
        """What cached annotation grids depend on besides the images and the input size."""
        cfg = self.config
        return {"backbone": cfg.backbone, "grid_size": cfg.grid_size,
                "channels_last": cfg.channels_last, "weights": fingerprint(self.encoder)}

    def forward(self, images: Tensor, captions: Tensor, lengths: Tensor) -> DecoderOutput:
        """Teacher-forced pass: captions (B, T+1) start with <start>; lengths include specials."""
        return self.decoder(self.encode(images, keep_half=True), captions, lengths)

    def generate(self, images: Tensor, decode: DecodeConfig | None = None, *,
                 grad: bool = False, generator: torch.Generator | None = None) -> Generation:
        """Decode captions with `decode` (default `self.decode`, as `captions`); call in eval
        mode. Hard models use their configured context rule.

        `num_captions` n > 1 gives N·n rows, image-major (`Generation.per_image`). Sampling
        draws with `generator`; `grad` keeps the graph of its log-probabilities (SCST)."""
        decode = decode if decode is not None else self.decode
        if grad and decode.strategy != "sample":
            raise ValueError(f"grad=True needs strategy 'sample', got {decode.strategy!r}")
        features = self.encode(images)
        if decode.strategy == "greedy":
            return greedy_search(self.decoder, features, max_len=decode.max_len,
                                 forbid_unk=decode.forbid_unk)
        if decode.strategy == "sample":
            return sample_search(self.decoder, features, num_samples=decode.num_captions,
                                 temperature=decode.temperature, max_len=decode.max_len,
                                 forbid_unk=decode.forbid_unk, grad=grad, generator=generator)
        settings = decode.beam_settings()
        search = self.beam_runner(features.device)
        if search is not None:
            return search(features, settings)
        return beam_search(self.decoder, features, **asdict(settings))

    def captions(self, images: Tensor, decode: DecodeConfig | None = None, *,
                 generator: torch.Generator | None = None) -> list[str]:
        """Captions as text (special tokens removed), decoded with `decode` or `self.decode`
        (sampling draws with `generator`); needs `self.vocab` (set by `from_pretrained`).
        Call in eval mode."""
        if self.vocab is None:
            raise ValueError("this captioner has no vocabulary: load it with "
                             "Captioner.from_pretrained(folder), or set .vocab")
        if self.training and (self.config.dropout > 0 or self.config.finetune_encoder):
            warnings.warn("captions() of a model in training mode: dropout (and a trainable "
                          "encoder's batch norm) change every call's captions; call "
                          "model.eval() first", stacklevel=2)  # once per calling line
        with torch.no_grad():
            gen = self.generate(images, decode, generator=generator)
        return [" ".join(self.vocab.decode(row[:n]))
                for row, n in zip(gen.tokens.tolist(), gen.lengths.tolist())]

    # -- shareable model folders (captioning.models.pretrained) --------------------------------
    def save_pretrained(self, path: str | os.PathLike[str], *, vocab: Vocabulary | None = None,
                        decode: DecodeConfig | None = None, card: str | None = None,
                        training: Mapping[str, Any] | None = None,
                        trained_on: Mapping[str, Any] | None = None) -> Path:
        """Write a model folder: model.safetensors, config.json, vocab.json, README.md (`card`,
        or a card made from the config). `vocab` and `decode` default to the model's own
        (`from_pretrained` sets them); `training`: the run's loss settings, `trained_on`: its
        data source and carving rule (default: the ones `from_pretrained` read, if any). The config
        is saved with `weights: null`: the backbone's weights are in the folder, rebuilding it
        downloads nothing. Returns the folder."""
        vocab = vocab if vocab is not None else self.vocab
        if vocab is None:
            raise ValueError("save_pretrained needs the vocabulary (vocab=...)")
        if len(vocab) != self.config.vocab_size:
            raise ValueError(f"vocabulary has {len(vocab)} words but the model was built for "
                             f"{self.config.vocab_size}")
        decode = decode if decode is not None else self.decode
        config = replace(self.config, weights=None).to_dict()
        if card is None:
            card = model_card(config, decode.to_dict(), len(vocab), folder=str(path))
        return write_model_folder(path, state=self.state_dict(), model=config,
                                  decode=decode.to_dict(), vocab=vocab, card=card,
                                  training=training if training is not None else
                                  self.loss_settings,
                                  trained_on=trained_on if trained_on is not None else
                                  self.trained_on)

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike[str], *,
                        device: str | torch.device = "cpu") -> Captioner:
        """The captioner of a model folder, in eval mode on `device`, with `.vocab` and
        `.decode` set. Reads JSON and safetensors only (no pickle); raises
        `captioning.models.pretrained.PretrainedError` (a ValueError naming the file)."""
        folder = read_model_folder(path)
        config = folder.config("model", CaptionerConfig.from_dict)
        decode = folder.config("decode", DecodeConfig.from_dict)
        folder.check_vocab_size(config.vocab_size)
        try:  # the backbone's weights come from the folder: never download them
            captioner = cls(replace(config, weights=None))
        except ValueError as e:
            raise PretrainedError(f"{folder.path / CONFIG_FILE}: invalid model config: "
                                  f"{e}") from None
        folder.load_into(captioner)
        captioner.vocab, captioner.decode = folder.vocab, decode
        captioner.loss_settings = dict(folder.training)
        captioner.trained_on = dict(folder.trained_on)
        return captioner.to(device).eval()
