"""The demo tokenizer's training text: plain English and a little Python, written for this project."""

CORPUS = r'''
A mixture of experts replaces one wide feed-forward block with many narrow ones. For every
token a small router scores all experts and only the best few are run. The model therefore
holds far more parameters than it uses for any single token, and most of those parameters
sit idle most of the time. That is why the experts can live in slower memory: the host RAM,
a fast disk, or another machine. The trick is to keep the experts that will be needed next
close to the processor, and to fetch the others before they are asked for.

Caching works because routing is not random. Some experts are popular in every layer, and a
token often reuses the experts chosen for the token before it. A cache that remembers the
recent and the frequent experts can serve most requests without a transfer. When it misses,
the engine waits for the copy, so the order of loads and the size of each transfer matter.

The weather turned cold on Tuesday. By the evening the river was grey and the wind came down
from the hills, carrying the smell of rain. Maria closed the shutters, lit the stove and put
a pot of soup on to simmer: onions, carrots, two potatoes, a handful of lentils and a bay
leaf. While it cooked she read the letter again. Her brother wrote that the harvest had been
good, that the new bridge was finally open, and that he would visit in the spring if the
roads allowed it. She smiled, folded the paper and set it beside the clock.

Questions people ask: How much memory does the model need? Which experts are used the most?
Why is the first token slow? Can I run it on a laptop? What happens when the cache is full?
The answers depend on the number of layers, the number of experts per layer, the width of
each expert and the bandwidth between the tiers. Measure first, then tune the budget.

Numbers and dates also appear in text: 1, 2, 3, 10, 42, 100, 256, 1024, 4096, 3.14, 0.5,
2024-05-17, 12:30, $19.99, 75%, version 1.2.3, page 7 of 12, room 404, row 8, column 16.

def load_config(path):
    """Read a JSON config file and return it as a dictionary."""
    with open(path, encoding="utf-8") as f:
        return json.load(f)


class ExpertCache:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.slots = {}
        self.hits = 0
        self.misses = 0

    def get(self, layer: int, expert: int):
        key = (layer, expert)
        if key in self.slots:
            self.hits += 1
            return self.slots[key]
        self.misses += 1
        return None

    def put(self, layer: int, expert: int, weights) -> None:
        if len(self.slots) >= self.capacity:
            oldest = next(iter(self.slots))
            del self.slots[oldest]
        self.slots[(layer, expert)] = weights


def top_k(scores, k):
    order = sorted(range(len(scores)), key=lambda i: scores[i], reverse=True)
    return order[:k]


for step in range(10):
    tokens = model.generate(prompt, max_new_tokens=32, temperature=0.7)
    print(f"step {step}: {tokenizer.decode(tokens)}")
    if tokens[-1] == eos_token_id:
        break

import numpy as np
x = np.zeros((4, 8), dtype=np.float32)
y = x @ x.T + 1.0
assert y.shape == (4, 4), "shape mismatch"

The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs. A
journey of a thousand miles begins with a single step. Knowledge is power, but only when
it is shared. The early bird catches the worm, yet the second mouse gets the cheese.

Once upon a time there was a small robot who lived in a library. Every night, when the
readers had gone home, it walked between the shelves and put the books back in order. It
liked history best, because history was full of people who had made mistakes and tried
again. One night it found a book with no title. The pages were blank except for the last
one, which said: "Write what you learn." So the robot began to write, slowly at first and
then faster, until the book was full and the sun was rising over the city.

Instructions: preheat the oven to 200 degrees. Mix the flour, salt and sugar in a large
bowl. Add the butter and rub it in with your fingers until the mixture looks like fine
breadcrumbs. Stir in the milk, knead gently, roll out and cut into rounds. Bake for twelve
to fifteen minutes until golden. Serve warm with jam and cream.

User: Can you explain what a hash function is?
Assistant: A hash function maps data of any size to a fixed-size value. Good hash functions
spread inputs evenly, so that similar inputs give very different outputs. They are used in
hash tables, checksums, and to verify that a downloaded file has not been damaged.

User: Write a function that reverses a string.
Assistant: Here is a short version in Python:

def reverse(text: str) -> str:
    return text[::-1]

User: Thank you! What is the capital of France?
Assistant: The capital of France is Paris.

Error messages should say what went wrong, where, and what to do next. For example:
"config.json: num_experts_per_tok=9 must be between 1 and 8" is better than "invalid value".
Logs should be short. Tests should be fast. Code should be read more often than it is written.

In the morning the market filled with voices: fishmongers calling prices, children chasing
pigeons, an old man tuning a violin on the steps of the church. Tomatoes, peppers, figs,
cheese, bread still warm from the bakery. Everyone seemed to know everyone else, and news
travelled from stall to stall faster than any newspaper could print it.

$ pip install expertcache
$ expertcache demo --max-new-tokens 64 --budget 512MiB
$ ls -lh ~/.cache/expertcache/ && du -sh models/*
$ git log --oneline | head -n 5; grep -rn "TODO" src/ tests/

{"name": "expert-cache", "layers": 48, "experts": 128, "top_k": 8, "dtype": "bfloat16"}

SELECT layer, expert, COUNT(*) AS uses FROM routing_trace
WHERE step BETWEEN 100 AND 200 GROUP BY layer, expert ORDER BY uses DESC LIMIT 10;

Science notes. Photosynthesis converts sunlight, water and carbon dioxide into glucose and
oxygen. Mitochondria release energy from food. Gravity bends the paths of planets around
stars; tides follow the moon. Sound travels through air as a pressure wave, while light
needs no medium at all. Volcanoes, glaciers, earthquakes and erosion shape mountains and
valleys over millions of years. Vaccines train the immune system to recognise viruses.

History notes. Ancient libraries in Alexandria, Baghdad and Timbuktu collected manuscripts
on astronomy, medicine, geometry and law. The printing press made books cheaper, which
spread literacy, pamphlets, newspapers and arguments. Railways shrank continents; telegraph
wires carried messages across oceans within minutes; later, radios, televisions, satellites
and finally smartphones connected billions of households.

Kitchen vocabulary: garlic, ginger, basil, oregano, cinnamon, pepper, vinegar, olive oil,
yoghurt, noodles, dumplings, pancakes, omelette, risotto, curry, salad, sandwich, biscuits,
chocolate, strawberries, blueberries, lemons, walnuts, almonds, honey, porridge, cabbage.

Sports and games: football, basketball, tennis, cricket, swimming, cycling, marathon, chess,
referee, tournament, championship, goalkeeper, penalty, stadium, scoreboard, victory, defeat.

Feelings and actions: happy, anxious, curious, grateful, tired, surprised, proud, jealous;
running, jumping, whispering, laughing, remembering, forgetting, building, breaking, fixing,
travelling, explaining, listening, wondering, hoping, deciding, borrowing, returning.

async def fetch_expert(layer_id: int, expert_id: int, stream=None) -> torch.Tensor:
    buffer = pinned_pool.acquire(expert_bytes)
    await loop.run_in_executor(None, reader.readinto, buffer, offsets[layer_id][expert_id])
    with torch.cuda.stream(stream):
        tensor = buffer.to(device, non_blocking=True)
    return tensor

try:
    result = engine.step(batch)
except MemoryError as exc:
    logger.warning("out of memory at step %d: %s", step, exc)
    raise
finally:
    profiler.stop()

while queue and not stopped:
    request = queue.popleft()
    yield from handle(request)

lambda pair: (pair[1], -pair[0]); dict(zip(keys, values)); [x * 2 for x in items if x > 0]
'''
