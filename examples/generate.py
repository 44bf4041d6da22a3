"""Generate from the embedded demo model, greedy and sampled, and stream a chat reply."""

from lily import Engine

engine = Engine.load()
print("greedy:", engine.generate("ROMEO.\n", max_tokens=40, temperature=0.0).text)
print("sampled:", engine.generate("ROMEO.\n", max_tokens=40, temperature=0.8, seed=3).text)

print("chat: ", end="")
for event in engine.stream_chat([{"role": "user", "content": "Speak of love."}],
                                chat_template_kwargs={"enable_thinking": False}, max_tokens=40):
    print(event.text, end="", flush=True)
print()
