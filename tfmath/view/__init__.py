"""Interactive attention views: weights in, one self-contained HTML page or fragment out.

Four views of the same data, switched by tabs:

* **head**: every head of one layer overlaid in its own colour, a line from the
  focused query token to each key with the weight as its opacity; hover a token
  to preview its lines (a key token: every query's line to it), click or focus
  a query token to keep them; a toggle per head;
* **model**: the layers x heads grid of thumbnails (each the full map, one pixel
  per weight, the focused query's row marked); clicking one opens it in the head
  view;
* **rows**: one head's row of weights for the focused query, as bars with numbers;
* **neuron** (when ``query`` and ``key`` vectors are given): for a query and a key
  token, the two vectors, their elementwise product, the score, the scaled score
  and the softmax over the keys, the steps of seed 003's worked example.

The weights are stored once, as 16-bit (or, for large inputs, 8-bit) fractions of
1, deflated and base64-encoded, and drawn on demand; the page states the
precision. Style and script are scoped to the view's root element, so a view
embedded in a notebook, the docs or any page changes nothing outside it, and
several views on one page are independent. Nothing is loaded from the network.

For outside checks each query token carries ``data-token-index``, each drawn
weight (bar or line) ``data-key-index`` and ``data-weight``, each head-view line
and head toggle ``data-head``, and each model-view cell ``data-layer`` and
``data-head``.
"""

from tfmath.view._page import AttentionView
from tfmath.view._views import attention_vectors, attention_view

__all__ = ["AttentionView", "attention_vectors", "attention_view"]
