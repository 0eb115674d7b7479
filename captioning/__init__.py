"""Show, Attend and Tell image captioning (Xu et al. 2015) with soft and hard attention."""

__version__ = "0.1.0"
