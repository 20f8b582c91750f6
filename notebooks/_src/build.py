"""Convert percent-format .py sources into .ipynb notebooks (no outputs)."""
import sys, nbformat
from nbformat.v4 import new_notebook, new_code_cell, new_markdown_cell

def convert(src, dst):
    cells, kind, buf = [], None, []
    def flush():
        if kind is None: return
        text = "\n".join(buf).strip("\n")
        if kind == "md":
            text = "\n".join(l[2:] if l.startswith("# ") else l.lstrip("#") for l in text.splitlines())
            cells.append(new_markdown_cell(text))
        else:
            cells.append(new_code_cell(text))
    for line in open(src).read().splitlines():
        if line.startswith("# %%"):
            flush(); buf = []
            kind = "md" if "[markdown]" in line else "code"
        else:
            buf.append(line)
    flush()
    nb = new_notebook(cells=cells, metadata={"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"},
                                              "language_info": {"name": "python"}})
    nbformat.write(nb, dst)

if __name__ == "__main__":
    convert(sys.argv[1], sys.argv[2])
