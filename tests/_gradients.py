"""Gradients by central differences, the check every analytic backward pass is held to."""

import numpy as np


def central_differences(loss, arrays, step=1e-6):
    """``d loss / d array`` for each of ``arrays`` (float64), one entry at a time.

    Central differences err by O(step^2) plus O(eps / step) of rounding, about
    1e-10 relative for step 1e-6 in float64.
    """
    gradients = []
    for position, array in enumerate(arrays):
        numeric = np.zeros_like(array)
        for index in np.ndindex(array.shape):
            shifted = [a.copy() for a in arrays]
            shifted[position][index] += step
            upper = loss(*shifted)
            shifted[position][index] -= 2 * step
            numeric[index] = (upper - loss(*shifted)) / (2 * step)
        gradients.append(numeric)
    return gradients
