"""The probes' output: ``say = log_to(path)`` prints each line and writes it to the file at once, so a run cut
short at its time limit keeps every line it printed."""


def log_to(path):
    out = open(path, "w")  # open for the whole run; every line is flushed as it is written

    def say(line):
        print(line, flush=True)
        out.write(line + "\n")
        out.flush()

    return say
