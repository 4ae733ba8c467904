"""The prompts bench latency times, one workload each: token rotations of one text (exact lengths, the default), free
chat answers, and a copy-heavy one (rewrite a given passage), the last two through the model's chat template.

Speculative decoding pays by workload: prompt-lookup drafts find the answer's next words in the prompt when the
answer copies it (rewrites, summaries, code edits), and rarely in a free answer.
"""

WORKLOADS = ("rotations", "chat", "copy")
TEXT = ("The lighthouse keeper climbed the spiral stairs every evening at dusk, carrying a lantern, a notebook "
        "and a flask of tea. From the gallery he watched the ships pass, wrote down their names and flags, and "
        "wondered where each was bound. One night a storm broke the great lens, and the keeper had to choose ")
QUESTIONS = (
    "What causes the seasons on Earth?", "How do I make a good cup of tea?", "Why is the sky blue?",
    "Give me three tips for learning a new language.", "What is a prime number?", "How does a bicycle stay upright?",
    "Write a short poem about the sea.", "What should I pack for a weekend hike?", "Explain what a database index is.",
    "How do plants make their food?", "What is the difference between weather and climate?",
    "Suggest a name for a small bakery.", "How can I sleep better?", "What does a compiler do?",
    "Tell me a fun fact about octopuses.", "How do vaccines work?", "What is inflation?",
    "Describe a sunset in two sentences.", "How do I start running as a beginner?", "Why do cats purr?",
    "What is the Pythagorean theorem?", "How are rainbows formed?", "What makes a good presentation?",
    "Explain recursion to a child.", "What is the capital of Australia and why?", "How do airplanes fly?",
    "What are the benefits of reading fiction?", "How should I store fresh herbs?", "What is a black hole?",
    "Give me an idea for a birthday gift for a gardener.", "How does the internet carry a message?",
    "Why do leaves change colour in autumn?")
PASSAGES = (
    TEXT + "between rowing out to a ship in distress and keeping the light burning with a borrowed oil lamp.",
    "The town library opens at nine every morning. Its reading room has tall windows, long oak tables and a "
    "quiet corner for children, where a volunteer reads stories aloud on Saturdays. Members may borrow up to "
    "six books for three weeks, and the librarian will order any title the shelves do not hold.",
    "To repot a houseplant, water it the day before, then ease it out of its old pot and loosen the roots with "
    "your fingers. Choose a pot one size larger with a drainage hole, add fresh compost, set the plant at the "
    "same depth as before, fill around it, press the soil gently and water it well.",
    "The museum's new exhibition follows a single river from its source in the mountains to the sea. Maps, "
    "photographs and objects found along its banks show how farmers, millers and traders lived beside it, and "
    "a model of the old harbour shows the ships that once carried grain and timber down to the coast.",
    "Our team meets every Monday at ten to plan the week. Each person shares what they finished, what they will "
    "do next and anything that blocks them. Notes go into the shared document, and any task without an owner "
    "is assigned before the meeting ends, so that nothing waits for the next Monday.",
    "Bread needs only flour, water, salt and yeast. Mix them into a rough dough, rest it for twenty minutes, "
    "then knead until it is smooth and springy. Let it rise until doubled, shape it into a loaf, let it rise "
    "again and bake it in a hot oven until the crust is brown and the base sounds hollow when tapped.",
    "The village holds a market in the square on the first Saturday of every month. Farmers sell vegetables, "
    "cheese and honey, a baker brings bread still warm from the oven, and a band plays by the fountain. In "
    "winter the stalls move into the old hall, and the market closes an hour earlier.",
    "The train to the coast leaves from platform four every hour, on the hour. The journey takes two hours and "
    "passes through three small towns and a long valley of orchards. Tickets bought online are cheaper, and "
    "bicycles travel free in the last carriage if there is room.",
)
INSTRUCTIONS = ("Rewrite the following passage in your own words, keeping every detail:",
                "Repeat the following passage, correcting any mistakes:",
                "Rewrite the following passage as if you were telling a friend:",
                "Copy the following passage, then add one sentence at the end:")


def rotations(tokenizer, batch_size: int, input_len: int, first: int = 0) -> list[list[int]]:
    """batch_size different prompts of exactly input_len tokens (rotations of one text, from rotation `first`: no
    shared prefix)."""
    ids = tokenizer.encode(TEXT * (1 + input_len // 40), add_special_tokens=False)
    return [(ids[row:] + ids[:row])[:input_len] for row in range(first, first + batch_size)]


def chat_requests(workload: str, tokenizer, batch_size: int, first: int = 0) -> list[list[int]]:
    """batch_size different chat prompts (token ids through the chat template) of the chat or copy workload."""
    from jax_engine.chat_template import chat_prompt

    if workload == "chat":
        contents = QUESTIONS
    else:
        contents = [f"{instruction}\n\n{passage}" for instruction in INSTRUCTIONS for passage in PASSAGES]
    picked = [contents[i % len(contents)] for i in range(first, first + batch_size)]
    # Prompts past the first round (warm-up runs) get a system message of their own: no prefix shared with the
    # timed prompts, so none of theirs is served from the prefix cache.
    system = [{"role": "system", "content": "Answer briefly."}] if first else []
    return [chat_prompt(tokenizer, [*system, {"role": "user", "content": c}])["prompt_token_ids"] for c in picked]


def workload_prompts(workload: str, tokenizer, batch_size: int, input_len: int, first: int = 0) -> list[list[int]]:
    """The workload's batch_size prompts, from prompt number `first` on (input_len: the rotations' length only)."""
    if workload == "rotations":
        return rotations(tokenizer, batch_size, input_len, first)
    return chat_requests(workload, tokenizer, batch_size, first)
