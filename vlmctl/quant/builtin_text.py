"""A small built-in calibration text, used when no calibration data is named.

It exists so that `vlmctl build` with AWQ works out of the box (tests, demos). It is short and
generic: for a real model, calibrate on text like the model's traffic (`--calib-data`); the
quantizer logs when it got fewer calibration blocks than asked for. Written for vlmctl; one
record per line.
"""

BUILTIN_CALIBRATION_TEXT = """\
The river rises in the hills north of the town and runs south through farmland before it reaches the sea. In spring the water is high and brown with soil; by late summer it is low enough to cross on foot in several places.
Photosynthesis turns light, water and carbon dioxide into sugar and oxygen. Most of it happens in the leaves, inside small green bodies called chloroplasts, and the sugar feeds the growth of the whole plant.
A good recipe for bread needs only flour, water, salt and yeast. Mix them, knead the dough for ten minutes, let it rise for an hour, shape it, let it rise again and bake it in a hot oven until the crust is dark.
The committee met on Tuesday to review the budget. After a long discussion, it agreed to spend more on school buildings and public transport, and to postpone the new library until the following year.
User: Can you describe what is in this picture? Assistant: The picture shows a red bicycle leaning against a white wall. A small dog is sitting next to it, and there are flowers in a pot on the left.
User: What is the capital of France? Assistant: The capital of France is Paris, which is also its largest city.
User: Write a short poem about the moon. Assistant: Silver lamp above the hill, quiet while the town is still; it lends the sea a borrowed light and walks the sky the whole night.
To sort a list in Python, call sorted(items) for a new list or items.sort() to sort it in place. Both accept a key function, for example sorted(words, key=len) sorts words by their length.
def mean(values):\n    total = 0\n    for v in values:\n        total += v\n    return total / len(values)
The experiment used three groups of twenty mice. The first group received no treatment, the second a low dose and the third a high dose. After six weeks, the weight of each animal was measured again.
In 1969 two astronauts walked on the surface of the moon while a third stayed in orbit. They collected rocks, set up instruments and returned to Earth four days later.
The price of the ticket is 12 dollars for adults and 6 dollars for children under 12. Groups of more than 10 people receive a discount of 15 percent, and entry is free on the first Sunday of each month.
A transformer model reads a sequence of tokens, turns each into a vector, and mixes information between positions with attention. Stacking many such layers lets the model learn long-range patterns in text and images.
The old lighthouse stands on a rock at the end of the harbour wall. It has not been used for ships since 1985, but visitors can climb its spiral stairs and look out over the bay on clear days.
Please find attached the report for the third quarter. Sales grew by eight percent compared with last year, mainly in the northern region, while costs stayed almost flat. Let me know if you have any questions.
When the water boils, add the pasta and a pinch of salt. Stir it once or twice, cook it for nine to eleven minutes, drain it and mix it with the sauce while it is still hot.
Mountains form when plates of the Earth's crust push against each other. Over millions of years the rock folds and rises, while wind, rain and ice slowly wear the peaks down again.
The train leaves the central station at 8:15 and arrives at the airport at 8:52. On weekends it runs every thirty minutes, and the last train of the day leaves at 23:40.
She opened the window, looked at the empty street for a while, and then sat down to write the letter she had been putting off for weeks.
Doctors recommend at least seven hours of sleep each night for adults. Regular exercise, a steady schedule and less screen time in the evening can all help people fall asleep more easily.
"""
