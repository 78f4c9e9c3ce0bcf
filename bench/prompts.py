"""The 20 chat prompts of the cross-engine rules (tests/integration/rules.py) and the benchmarks
that measure against them (bench/bench_fp8_quality.py)."""

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis to a child.",
    "List three uses of a paperclip.",
    "What is 17 times 23?",
    "Translate 'thank you' into Spanish.",
    "Give me a recipe for pancakes.",
    "Why do cats purr?",
    "Summarise the plot of Romeo and Juliet in two sentences.",
    "What is the difference between a virus and a bacterium?",
    "Suggest a name for a bakery.",
    "How does a refrigerator keep food cold?",
    "Write a limerick about a programmer.",
    "What causes the seasons on Earth?",
    "Describe the colour blue to someone who cannot see.",
    "Give two arguments for learning a second language.",
    "What is a prime number? Give examples.",
    "How do I make a cup of green tea?",
    "Tell me a fun fact about octopuses.",
    "Plan a one-day trip to Kyoto.",
]
