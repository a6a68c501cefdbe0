"""The names of the small integer codes the engine stores, and the interface of a node's rule.

Nodes, tensors and rules keep these as plain ints (compiled modules compare them as C ints:
their ``.pxd`` files declare typed copies), so this module is the only place a number stands
for a meaning. The rule kinds (DIFFERENTIABLE, DECOMPOSITION, NONDIFFERENTIABLE) are the
registry's and live in ``rules.py``.
"""

from __future__ import annotations

from typing import Protocol

__all__ = [
    "KEEP_NOTHING", "KEEP_VALUE", "KEEP_META",
    "NOT_RELEASED", "RELEASED_AFTER_BACKWARD", "RELEASED_WITH_GRAPH",
    "NO_VIEW_TAG", "NO_GRAD_VIEW", "MULTI_OUTPUT_VIEW", "PLAIN_VIEW", "CUSTOM_FUNCTION_VIEW",
    "CUSTOM_MULTI_VIEW",
    "NOT_A_VIEW", "CUSTOM_OUTPUTS", "NEVER_SEEN",
    "GG_LEAF", "TORCH_LEAF", "TORCH_BRIDGE",
    "NO_GRAD", "NEEDS_GRAD", "TORCH_TRACKED",
    "PARAM_POSITIONAL", "PARAM_VAR_POSITIONAL", "PARAM_KEYWORD_ONLY", "PARAM_VAR_KEYWORD",
    "NodeRule",
]

# -- what a node keeps of each rule parameter (Rule.keep[i]) --------------------------------
KEEP_NOTHING = 0  # the rule does not read it
KEEP_VALUE = 1  # the value (version-checked at use)
KEEP_META = 2  # its shape/dtype/device only (rules.Meta)

# -- how a rule parameter takes its argument (Rule.kinds[i]) --------------------------------
PARAM_POSITIONAL = 0  # by position or by name
PARAM_VAR_POSITIONAL = 1  # *args: the positional arguments left over, as a tuple
PARAM_KEYWORD_ONLY = 2  # by name only
PARAM_VAR_KEYWORD = 3  # **kwargs: the keyword arguments no parameter names, as a dict

# -- Node.released ------------------------------------------------------------------------
NOT_RELEASED = 0
RELEASED_AFTER_BACKWARD = 1  # a backward pass without retain_graph ran it
RELEASED_WITH_GRAPH = 2  # its AutogradGraph context exited: never runnable again

# -- Tensor._gg_view_tag: how torch marks a view (its creation_meta) -------------------------
NO_VIEW_TAG = 0  # not a view, or one with no special mark
NO_GRAD_VIEW = 1  # made under no_grad (or by an unrecorded split/chunk/unbind)
MULTI_OUTPUT_VIEW = 2  # an output of split/chunk/unbind
PLAIN_VIEW = 3  # made with grad mode on of a tensor that required no grad (may be revived)
CUSTOM_FUNCTION_VIEW = 4  # a view a gg.Function returned (or an input it returned as is)
CUSTOM_MULTI_VIEW = 5  # the same, from a Function with several differentiable outputs

# -- Node.view_version / Tensor._gg_view_version: a view's version counter + 1 when stamped --
NOT_A_VIEW = 0  # Node.view_version of a node that is no view's grad_fn (stamps are >= 1)
CUSTOM_OUTPUTS = -1  # Node.view_version of a Function's node that returned views: checked at use
NEVER_SEEN = 0  # Tensor._gg_view_version before the view was stamped

# -- AccumulateGrad.torch_kind: whose tensor the gradient goes to ---------------------------
GG_LEAF = 0  # a graphgrad leaf: into its .grad
TORCH_LEAF = 1  # a plain torch leaf with torch's requires_grad=True: into its .grad, running
#               # the hooks registered on it with torch's register_hook
TORCH_BRIDGE = 2  # a tensor torch's own autograd computed: handed to torch's backward

# -- what dispatch's scan of a call's arguments found ----------------------------------------
NO_GRAD = 0  # no argument requires grad
NEEDS_GRAD = 1  # one does
TORCH_TRACKED = 2  # one does and is tracked by torch's own autograd: its kernel runs with
#                  # torch's grad mode off (torch must not record what graphgrad records)


class NodeRule(Protocol):
    """What the engine reads from a node's ``rule``: the one interface of three shapes.

    Implemented by ``rules.Rule`` (a registered derivative; ``Node.apply`` also calls its
    ``fn`` as its ``kinds`` say and reads ``wants_needs``), by ``function._FunctionRule``
    (a ``gg.Function``'s node, whose ``apply`` runs the Function's ``backward``) and by
    ``node._AccumulateRule`` (a leaf's AccumulateGrad, which never applies a rule).
    """

    name: str  # the node's name, e.g. "MulBackward"
    params: tuple  # the rule's parameter names after grad (saved_values, error messages)
    keep: tuple  # per parameter, KEEP_NOTHING / KEEP_VALUE / KEEP_META
    multi_output: bool  # does backward get one gradient per output (else the first alone)?
    known_zeros: bool  # may its gradients be torch's efficient zero (Note [known-zero gradients])?
