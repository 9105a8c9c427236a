"""A deterministic training text for the default model's tokenizer (and model).

Generated from small word banks with a seeded RNG, so the build needs no
network and no data file; it mixes in accented, Cyrillic, CJK and emoji words so
the tokenizer learns multi-byte characters and the tests can exercise them.
"""

from __future__ import annotations

import random

SUBJECTS = [
    "the cat",
    "a dog",
    "the model",
    "my friend",
    "the server",
    "a small bird",
    "the teacher",
    "our team",
    "the engine",
    "a robot",
    "the river",
    "an old man",
    "the child",
    "the city",
    "a student",
    "the market",
    "the scheduler",
    "a replica",
    "the cluster",
    "the kernel",
]
VERBS = [
    "sees",
    "likes",
    "builds",
    "serves",
    "finds",
    "reads",
    "writes",
    "moves",
    "helps",
    "watches",
    "answers",
    "carries",
    "follows",
    "opens",
    "closes",
    "paints",
    "learns",
    "sends",
    "keeps",
    "brings",
]
OBJECTS = [
    "the red ball",
    "a long letter",
    "the green door",
    "many requests",
    "a quiet song",
    "the morning light",
    "a cup of tea",
    "the first token",
    "a warm bread",
    "the blue sky",
    "a busy street",
    "the last train",
    "a new idea",
    "the big garden",
    "a simple answer",
    "the open window",
    "a fast batch",
    "the tiny model",
    "a bright star",
    "the old book",
]
PLACES = [
    "in the park",
    "at home",
    "near the sea",
    "on the table",
    "under the bridge",
    "after dinner",
    "before noon",
    "in the café",
    "at the station",
    "in the garden",
    "on the hill",
    "by the window",
    "in the morning",
    "at night",
    "in Zürich",
    "in München",
    "à Paris",
    "in Tōkyō",
    "в Москве",
    "在北京",
]
EXTRAS = [
    "It is a naïve idea.",
    "Ça va très bien.",
    "Schöne Grüße!",
    "Привет, мир!",
    "日本語は難しい。",
    "数据很重要。",
    "I like it 🙂.",
    "Great work 🚀!",
    "The price is 5 €.",
    "It costs £3.",
    "¿Dónde está?",
    "Smörgåsbord is tasty.",
    "Crème brûlée, s'il vous plaît.",
    "こんにちは世界",
    "안녕하세요",
    "Γειά σου κόσμε",
    "señor José",
    "façade and déjà vu",
]
QUESTIONS = [
    "what does {s} see?",
    "where is {s}?",
    "why does {s} like {o}?",
    "who {v} {o}?",
    "can you tell me about {o}?",
    "how does {s} work?",
]


def sentences(count: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        roll = rng.random()
        if roll < 0.15:
            out.append(rng.choice(EXTRAS))
        elif roll < 0.30:
            q = rng.choice(QUESTIONS).format(
                s=rng.choice(SUBJECTS), v=rng.choice(VERBS), o=rng.choice(OBJECTS)
            )
            out.append(q[0].upper() + q[1:])
        else:
            s = f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)}"
            if rng.random() < 0.6:
                s += f" {rng.choice(PLACES)}"
            out.append(s[0].upper() + s[1:] + rng.choice([".", ".", ".", "!", "?"]))
    return out
