"""capgen.py's weight initialisation (`net.weight_init: capgen`), for the authors' network.

The authors' code draws every weight matrix from N(0, 0.01²), or a random orthogonal matrix
where it is square (`norm_weight`, `ortho_weight`); the LSTM's recurrent matrix U is orthogonal
gate by gate, its input W gate by gate and its context weight W_c whole where square; the attention's key projection (`Wc_att`) is never orthogonal; every bias and the
embedding's rows (N(0, 0.01²)) start so too. PyTorch's defaults (`torch`) are the project's.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

SCALE = 0.01  # capgen.py's norm_weight scale


def norm_weight(weight: Tensor, *, ortho: bool = True) -> None:
    """capgen.py's `norm_weight`, in place: orthogonal when square (and `ortho`), else
    N(0, SCALE²). `weight` may be a view (a gate's block of the LSTM's matrices)."""
    if ortho and weight.size(0) == weight.size(1):
        weight.copy_(nn.init.orthogonal_(torch.empty_like(weight)))
    else:
        weight.normal_(0.0, SCALE)


@torch.no_grad()
def capgen_init(decoder: nn.Module, *, embed_dim: int) -> None:
    """Initialise a decoder's weights as capgen.py does (its embedding is `embed_dim` wide:
    the LSTM's input weight is [W | W_c], the previous word's part first). Every linear layer
    is set so, a scorer of one's own included; other modules keep their own initialisation."""
    for name, module in decoder.named_modules():
        if isinstance(module, nn.Embedding):
            module.weight.normal_(0.0, SCALE)
        elif isinstance(module, nn.Linear):
            norm_weight(module.weight, ortho=not name.endswith("attention.key"))  # Wc_att
            if module.bias is not None:
                module.bias.zero_()
        elif isinstance(module, nn.LSTMCell):
            H = module.hidden_size
            for g in range(4):  # i, f, g, o: capgen.py concatenates one matrix per gate
                rows = slice(g * H, (g + 1) * H)
                norm_weight(module.weight_ih[rows, :embed_dim])  # W (the previous word)
                norm_weight(module.weight_hh[rows])  # U: orthogonal
            norm_weight(module.weight_ih[:, embed_dim:])  # W_c: one (D, 4H) matrix in capgen.py
            module.bias_ih.zero_()
            module.bias_hh.zero_()
