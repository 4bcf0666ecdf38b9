"""An interactive attention view: tokens and weights in, a standalone HTML page out.

The page embeds its data as JSON, its style and its script inline, so it works
from ``file://`` with no network. Clicking or focusing a query token shows its
row of weights over the keys (bars and highlighted key tokens); the arrow keys
move between tokens; ``<select>`` elements choose the layer and head.

For outside checks each token element carries ``data-token-index`` and each
shown weight ``data-key-index`` and ``data-weight`` (``repr`` of the float).
"""

import html
import json
import os
import tempfile
import uuid

import numpy as np

from tfmath._contract.checks import host_array, integer
from tfmath.errors import ArgumentError, ShapeError

__all__ = ["AttentionView", "attention_view"]

_ROW_SUM_TOLERANCE = 1e-6

_STYLE = """
body{font-family:system-ui,sans-serif;margin:1em;line-height:1.4}
.tfv-tokens button{font:inherit;margin:2px;padding:2px 6px;border:1px solid #888;
border-radius:4px;background:#fff;cursor:pointer}
.tfv-tokens button[aria-pressed=true]{outline:3px solid #1f5fbf}
.tfv-bar{display:flex;align-items:center;gap:.5em;margin:1px 0}
.tfv-bar span.k{width:8em;text-align:right;overflow:hidden}
.tfv-bar div.b{height:1em;background:#1f5fbf}
.tfv-masked{color:#999;text-decoration:line-through}
"""

_SCRIPT = """
(function(){
const root=document.getElementById(ROOT_ID);
const data=JSON.parse(root.querySelector('script.tfv-data').textContent);
const layerSel=root.querySelector('select.tfv-layer');
const headSel=root.querySelector('select.tfv-head');
const queries=Array.from(root.querySelectorAll('.tfv-queries button'));
const keys=Array.from(root.querySelectorAll('.tfv-keys span'));
const bars=root.querySelector('.tfv-bars');
let current=0;
function show(i){
  current=i;
  const row=data.weights[+layerSel.value][+headSel.value][i];
  const masked=data.mask?data.mask[i]:null;
  queries.forEach((b,j)=>b.setAttribute('aria-pressed',j===i?'true':'false'));
  bars.textContent='';
  row.forEach((w,k)=>{
    const isMasked=masked!==null&&!masked[k];
    const line=document.createElement('div');
    line.className='tfv-bar'+(isMasked?' tfv-masked':'');
    line.setAttribute('data-key-index',k);
    if(isMasked){line.setAttribute('data-masked','true');}
    else{line.setAttribute('data-weight',data.repr[+layerSel.value][+headSel.value][i][k]);}
    const label=document.createElement('span');label.className='k';
    label.textContent=data.keys[k];
    const bar=document.createElement('div');bar.className='b';
    bar.style.width=(isMasked?0:Math.round(300*w))+'px';
    const value=document.createElement('span');
    value.textContent=isMasked?'masked':w.toFixed(3);
    line.append(label,bar,value);bars.append(line);
    const key=keys[k];
    key.className=isMasked?'tfv-masked':'';
    key.style.background=isMasked?'':'rgba(31,95,191,'+w.toFixed(3)+')';
    key.style.color=!isMasked&&w>0.5?'#fff':'';
  });
}
queries.forEach((b,i)=>{
  b.addEventListener('click',()=>show(i));
  b.addEventListener('focus',()=>show(i));
  b.addEventListener('keydown',e=>{
    let j=null;
    if(e.key==='ArrowRight'||e.key==='ArrowDown'){j=Math.min(i+1,queries.length-1);}
    if(e.key==='ArrowLeft'||e.key==='ArrowUp'){j=Math.max(i-1,0);}
    if(j!==null){e.preventDefault();queries[j].focus();show(j);}
  });
});
layerSel.addEventListener('change',()=>show(current));
headSel.addEventListener('change',()=>show(current));
layerSel.value=String(data.selected[0]);headSel.value=String(data.selected[1]);
show(data.selected[2]);
})();
"""


class AttentionView:
    """A rendered attention view.

    Attributes
    ----------
    html : str
        The standalone HTML page.
    """

    def __init__(self, page, fragment):
        self.html = page
        self._fragment = fragment

    def save(self, path):
        """Write the page to ``path`` atomically (temporary file, then rename).

        Parameters
        ----------
        path : str or os.PathLike
            Where to write the page.
        """
        path = os.fspath(path)
        folder = os.path.dirname(os.path.abspath(path))
        handle, temporary = tempfile.mkstemp(dir=folder, suffix=".tmp")
        try:
            with os.fdopen(handle, "w", encoding="utf-8") as stream:
                stream.write(self.html)
            os.replace(temporary, path)
        except BaseException:
            os.unlink(temporary)
            raise

    def _repr_html_(self):
        # A fresh root id per view, so several views in one notebook do not clash.
        return self._fragment


def _names(name, given, count, default):
    if given is None:
        return [f"{default} {i}" for i in range(count)]
    given = [str(item) for item in given]
    if len(given) != count:
        raise ArgumentError(f"{name} must have {count} entries, got {len(given)}")
    return given


def attention_view(
    tokens,
    weights,
    *,
    query_tokens=None,
    mask=None,
    title=None,
    layer_names=None,
    head_names=None,
    selected=(0, 0, 0),
):
    """Build an interactive view of attention weights.

    Parameters
    ----------
    tokens : sequence of str
        The key tokens (S of them); also the query tokens when
        ``query_tokens`` is None.
    weights : array_like
        Attention weights of shape (heads, L, S) or (layers, heads, L, S):
        finite, non-negative, each row summing to 1 over its unmasked keys.
    query_tokens : sequence of str, optional
        The L query tokens, when they differ from ``tokens``.
    mask : array_like of bool, optional
        Shape (L, S); False marks a key the query cannot see (its weight must be 0).
    title : str, optional
        The page title.
    layer_names, head_names : sequence of str, optional
        Labels for the layer and head selectors.
    selected : tuple of int, optional
        The ``(layer, head, query)`` shown when the page opens.

    Returns
    -------
    AttentionView
        With ``.html``, ``.save(path)`` and ``_repr_html_`` for Jupyter.

    Raises
    ------
    ShapeError
        If the weights are not 3- or 4-dimensional or do not match the tokens.
    ArgumentError
        If a weight is negative or not finite, a row does not sum to 1, a
        masked weight is not 0, or ``selected`` is out of range.
    """
    keys = [str(token) for token in tokens]
    queries = keys if query_tokens is None else [str(token) for token in query_tokens]
    array = np.asarray(host_array("weights", weights), dtype=np.float64)
    if array.ndim == 3:
        array = array[None]
    if array.ndim != 4:
        raise ShapeError(
            f"weights must have shape (heads, L, S) or (layers, heads, L, S), got {array.shape}"
        )
    layers, heads, length, sources = array.shape
    if length != len(queries) or sources != len(keys):
        raise ShapeError(
            f"weights of shape {array.shape} need {length} query tokens and {sources} "
            f"key tokens, got {len(queries)} and {len(keys)}"
        )
    if not np.all(np.isfinite(array)):
        raise ArgumentError("weights must be finite")
    if np.any(array < 0):
        raise ArgumentError(f"weights must be non-negative, got minimum {array.min()!r}")
    visible = None
    if mask is not None:
        visible = np.asarray(mask)
        if visible.dtype != np.bool_:
            raise ArgumentError(f"mask must be boolean, got dtype {visible.dtype}")
        if visible.shape != (length, sources):
            raise ShapeError(f"mask must have shape {(length, sources)}, got {visible.shape}")
        if np.any(array[..., ~visible] != 0):
            raise ArgumentError("weights must be 0 where mask is False")
    sums = array.sum(axis=-1)
    if not np.allclose(sums, 1.0, atol=_ROW_SUM_TOLERANCE, rtol=0):
        worst = float(np.abs(sums - 1.0).max())
        raise ArgumentError(f"each row of weights must sum to 1, worst deviation {worst!r}")
    selected = _selected(selected, (layers, heads, length))
    layer_labels = _names("layer_names", layer_names, layers, "layer")
    head_labels = _names("head_names", head_names, heads, "head")
    data = {
        "keys": keys,
        "queries": queries,
        "weights": array.tolist(),
        "repr": [[[[repr(float(w)) for w in row] for row in h] for h in lay] for lay in array],
        "mask": None if visible is None else visible.tolist(),
        "selected": selected,
    }
    root_id = "tfv-" + uuid.uuid4().hex
    # "</" would end the script element early; JSON allows the escaped form.
    payload = json.dumps(data).replace("</", "<\\/")

    def options(css, labels):
        items = "".join(
            f'<option value="{i}">{html.escape(label)}</option>' for i, label in enumerate(labels)
        )
        return f'<select class="{css}" aria-label="{css[4:]}">{items}</select>'

    query_buttons = "".join(
        f'<button type="button" data-token-index="{i}">{html.escape(t)}</button>'
        for i, t in enumerate(queries)
    )
    key_spans = " ".join(
        f'<span data-key-token-index="{k}">{html.escape(t)}</span>' for k, t in enumerate(keys)
    )
    heading = html.escape(title or "Attention")
    fragment = (
        f'<div id="{root_id}" class="tfv"><style>{_STYLE}</style>'
        f"<h2>{heading}</h2>"
        f"<p>{options('tfv-layer', layer_labels)} {options('tfv-head', head_labels)}</p>"
        f'<p class="tfv-tokens tfv-queries">Query: {query_buttons}</p>'
        f'<p class="tfv-keys">Keys: {key_spans}</p>'
        f'<div class="tfv-bars"></div>'
        f'<script type="application/json" class="tfv-data">{payload}</script>'
        f"<script>{_SCRIPT.replace('ROOT_ID', json.dumps(root_id))}</script></div>"
    )
    page = (
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width,initial-scale=1">'
        f"<title>{heading}</title></head><body>{fragment}</body></html>"
    )
    return AttentionView(page, fragment)


def _selected(selected, counts):
    """``selected`` as three in-range indices: layer, head, query."""
    if not isinstance(selected, tuple | list) or len(selected) != 3:
        raise ArgumentError(f"selected must be (layer, head, query), got {selected!r}")
    chosen = []
    for name, index, count in zip(("layer", "head", "query"), selected, counts, strict=True):
        index = integer(f"selected {name}", index, minimum=0)
        if index >= count:
            raise ArgumentError(f"selected {name} must be below {count}, got {index}")
        chosen.append(index)
    return chosen
