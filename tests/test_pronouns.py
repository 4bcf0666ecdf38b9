"""tfmath.training.pronouns: the grammar, the splits, the measurement of where "it" looks,
and a real training run that learns to resolve the pronoun."""

import numpy as np
import pytest
from scipy import stats

from tfmath.errors import ArgumentError, DTypeError
from tfmath.training import pronouns as P

ANIMALS = {"cat", "dog", "bird", "mouse", "fox", "rabbit"}
OBJECTS = {"mat", "rug", "bed", "box", "chair", "sofa", "pillow", "blanket"}
ANIMAL_ADJECTIVES = {"hungry", "tired", "sleepy", "scared", "happy", "curious"}
OBJECT_ADJECTIVES = {"soft", "warm", "flat", "clean", "thick", "new"}


@pytest.fixture(scope="module")
def sentences():
    return P.pronoun_sentences()


@pytest.fixture(scope="module")
def splits(sentences):
    return P.split_sentences(sentences, seed=0)


def test_every_sentence_has_one_antecedent_the_adjective_fits(sentences):
    texts = [sentences.text(row) for row in range(len(sentences.tokens))]
    assert len(set(map(tuple, texts))) == len(texts) == 6 * 8 * 12 * (6 + 4)
    for text, antecedent in zip(texts, sentences.antecedent, strict=True):
        assert len(text) == 10
        assert text[P.PRONOUN_POSITION] == "it"
        first, second, adjective = text[1], text[5], text[9]
        assert {first, second} & ANIMALS and {first, second} & OBJECTS
        fits = ANIMALS if adjective in ANIMAL_ADJECTIVES else OBJECTS
        assert adjective in ANIMAL_ADJECTIVES | OBJECT_ADJECTIVES
        expected = 1 if first in fits else 5
        assert antecedent == expected
        assert text[int(sum(P.NOUN_POSITIONS) - antecedent)] not in fits
    # Position alone does not give the answer away: each noun slot is the antecedent
    # for a sizeable share of the sentences, animals and objects alike.
    animal_first = np.array([text[1] in ANIMALS for text in texts])
    for order in (animal_first, ~animal_first):
        share = np.mean(sentences.antecedent[order] == 1)
        assert 0.4 < share < 0.6


def test_the_seed_sentence_is_in_the_grammar_and_refers_to_mat(sentences):
    row = sentences.index_of("The cat sat on the mat because it was soft")
    assert sentences.text(row)[sentences.antecedent[row]] == "mat"
    assert sentences.text(row)[sentences.distractor[row]] == "cat"
    with pytest.raises(ArgumentError, match="outside the grammar: \\['and'\\]"):
        sentences.index_of("the cat sat on the mat because it was hungry and")
    with pytest.raises(ArgumentError, match="not a sentence"):
        sentences.index_of("the cat sat on the cat because it was hungry")
    with pytest.raises(ArgumentError, match="not a sentence"):
        sentences.index_of("the cat sat on the mat")


def test_splits_partition_the_sentences_and_hold_out_the_seed_sentence(sentences, splits):
    n = len(sentences.tokens)
    together = np.concatenate([splits["train"], splits["selection"], splits["test"]])
    assert np.array_equal(np.sort(together), np.arange(n))
    assert [len(splits[part]) for part in ("train", "selection")] == [n // 2, round(n / 10)]
    assert sentences.index_of(P.SEED_SENTENCE) in splits["test"]
    again = P.split_sentences(sentences, seed=0)
    other = P.split_sentences(sentences, seed=1)
    assert all(np.array_equal(splits[part], again[part]) for part in splits)
    assert not np.array_equal(splits["train"], other["train"])


@pytest.mark.parametrize(
    ("fractions", "error"),
    [
        ((0.5, 0.5), ArgumentError),
        ((0.5, 0.1, 0.3), ArgumentError),
        ((0.9, 0.0, 0.1), ArgumentError),
    ],
)
def test_bad_fractions_are_refused(sentences, fractions, error):
    with pytest.raises(error, match="fractions"):
        P.split_sentences(sentences, fractions)


class _PlantedResolver(P.PronounResolver):
    """A resolver whose attention is planted, to check the measurement, not a model.

    Head (0, 0) attends to both nouns alike (much weight on the antecedent, no
    resolution); head (0, 1) resolves on the selection sentences only, head (1, 1)
    on the test sentences only; head (1, 0) puts a random share on the antecedent and
    the rest on the adjective. The logits name the antecedent except in every fifth sentence.
    """

    def __init__(self, sentences, splits):
        super().__init__(config=None, params=None, losses=np.zeros(0))
        self.sentences = sentences
        self.selection_rows = {tuple(row) for row in sentences.tokens[splits["selection"]]}

    def forward(self, tokens, *, backend="auto"):
        tokens = np.atleast_2d(tokens)
        rows = [
            self.sentences.index_of(" ".join(self.sentences.words[t] for t in s)) for s in tokens
        ]
        n = len(rows)
        antecedent = self.sentences.antecedent[rows]
        distractor = self.sentences.distractor[rows]
        weights = np.full((n, 2, 2, 10, 10), 0.1)
        it = P.PRONOUN_POSITION
        both = np.zeros((n, 10))
        both[np.arange(n), antecedent] = both[np.arange(n), distractor] = 0.5
        weights[:, 0, 0, it] = both
        in_selection = np.array([tuple(s) in self.selection_rows for s in tokens])
        on_antecedent = np.eye(10)[antecedent]
        weights[in_selection, 0, 1, it] = on_antecedent[in_selection]
        weights[~in_selection, 1, 1, it] = on_antecedent[~in_selection]
        share = np.random.default_rng(n).random((n, 1))
        weights[:, 1, 0, it] = share * on_antecedent + (1 - share) * np.eye(10)[9]
        logits = np.zeros((n, 10, len(self.sentences.words)))
        named = self.sentences.tokens[rows, antecedent]
        named[::5] = self.sentences.tokens[rows, distractor][::5]
        logits[np.arange(n), it, named] = 1.0
        return logits, np.moveaxis(weights, 0, 1)  # layers first, as the models give them


def test_the_head_is_chosen_on_the_selection_set_and_measured_on_the_test_set(sentences, splits):
    small = {part: rows[:200] for part, rows in splits.items()}
    result = P.antecedent_attention(_PlantedResolver(sentences, small), sentences, small)
    # (0, 1) resolves on the selection set, so it is chosen; on the test set it is uniform.
    assert (result.layer, result.head) == (0, 1)
    assert result.mass == pytest.approx(0.1)
    assert result.distractor_mass == pytest.approx(0.1)
    assert result.chance == 0.1
    assert result.selection_margin[0, 0] == pytest.approx(0.0)
    assert result.selection_margin[0, 1] == pytest.approx(1.0)
    np.testing.assert_allclose(result.test_mass[:, 1], [0.1, 1.0])
    assert result.test_mass[0, 0] == pytest.approx(0.5)
    assert result.accuracy == pytest.approx(1 - 40 / 200)
    assert result.n_test == 200


def test_interval_is_the_student_t_interval_of_the_test_masses(sentences, splits):
    small = {part: rows[:300] for part, rows in splits.items()}
    resolver = _PlantedResolver(sentences, small)
    # Head (1, 0) wins once (0, 1) and (1, 1) are blanked out.
    planted_forward = resolver.forward

    def forward(tokens, *, backend="auto"):
        logits, weights = planted_forward(tokens)
        weights[0, :, 1] = weights[1, :, 1] = 0.1
        return logits, weights

    resolver.forward = forward
    result = P.antecedent_attention(resolver, sentences, small, confidence=0.9)
    assert (result.layer, result.head) == (1, 0)
    _, weights = forward(sentences.tokens[small["test"]])
    antecedent = sentences.antecedent[small["test"]]
    masses = weights[1, np.arange(300), 0, P.PRONOUN_POSITION, antecedent]
    low, high = stats.t.interval(0.9, 299, loc=masses.mean(), scale=stats.sem(masses))
    assert result.mass == pytest.approx(masses.mean())
    assert result.interval == pytest.approx((low, high))
    assert result.confidence == 0.9
    is_animal = np.isin(
        [sentences.text(row)[a] for row, a in zip(small["test"], antecedent, strict=True)],
        list(ANIMALS),
    )
    assert result.mass_by_kind["animal"] == pytest.approx(masses[is_animal].mean())
    assert result.mass_by_kind["object"] == pytest.approx(masses[~is_animal].mean())
    on_adjective = weights[1, :, 0, P.PRONOUN_POSITION, 9]
    assert result.adjective_mass_by_kind["animal"] == pytest.approx(on_adjective[is_animal].mean())
    assert result.adjective_mass_by_kind["object"] == pytest.approx(on_adjective[~is_animal].mean())


def test_measurement_refuses_what_it_cannot_measure(sentences, splits):
    resolver = _PlantedResolver(sentences, splits)
    with pytest.raises(DTypeError, match="PronounResolver"):
        P.antecedent_attention(object(), sentences, splits)
    with pytest.raises(ArgumentError, match="at least 2 sentences"):
        P.antecedent_attention(resolver, sentences, {**splits, "test": splits["test"][:1]})
    with pytest.raises(ArgumentError, match="confidence"):
        P.antecedent_attention(resolver, sentences, splits, confidence=1.0)


def test_training_refuses_bad_rows(sentences):
    with pytest.raises(ArgumentError, match="rows"):
        P.train_pronoun_resolver(sentences, [])
    with pytest.raises(ArgumentError, match="rows must lie"):
        P.train_pronoun_resolver(sentences, [0, len(sentences.tokens)])
    with pytest.raises(DTypeError, match="PronounSentences"):
        P.train_pronoun_resolver("the cat", [0])


def test_training_is_reproducible(sentences, splits):
    first = P.train_pronoun_resolver(sentences, splits["train"], steps=5, seed=3)
    second = P.train_pronoun_resolver(sentences, splits["train"], steps=5, seed=3)
    other = P.train_pronoun_resolver(sentences, splits["train"], steps=5, seed=4)
    np.testing.assert_array_equal(first.losses, second.losses)
    assert not np.array_equal(first.losses, other.losses)


def test_a_trained_model_resolves_it_on_held_out_sentences(sentences, splits):
    """The real thing, shortened: the default model after 250 steps names the antecedent
    of nearly every unseen sentence, and its best head's interval lies above both
    uniform attention and the weight on the other noun."""
    resolver = P.train_pronoun_resolver(sentences, splits["train"], steps=250, seed=0)
    assert resolver.losses[-20:].mean() < 0.1 * resolver.losses[:20].mean()
    result = P.antecedent_attention(resolver, sentences, splits)
    assert result.accuracy > 0.95
    assert result.interval[0] > result.chance
    assert result.interval[0] > result.distractor_mass
    _, weights = resolver.forward(sentences.tokens[sentences.index_of(P.SEED_SENTENCE)])
    # float32 weights: a sum of ten terms is within 10 eps (1.2e-6) of 1.
    np.testing.assert_allclose(weights.sum(axis=-1), 1.0, atol=10 * np.finfo(np.float32).eps)
    assert weights.dtype == np.float32
