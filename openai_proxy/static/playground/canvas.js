// The canvas of one answer: the frames a denoise stream sent, and their drawing as a grid of
// token cells. Every token is put in the page with textContent: model text is never markup.

const RAMP = ["#440154", "#3b528b", "#21918c", "#5ec962", "#fde725"]; // early -> late step

function hexToRgb(hex) {
  const n = parseInt(hex.slice(1), 16);
  return [(n >> 16) & 255, (n >> 8) & 255, n & 255];
}

// Colour of a cell committed at `fraction` (0 = first step, 1 = last) of the run.
export function stepColour(fraction) {
  const f = Math.min(1, Math.max(0, fraction)) * (RAMP.length - 1);
  const i = Math.min(RAMP.length - 2, Math.floor(f));
  const a = hexToRgb(RAMP[i]);
  const b = hexToRgb(RAMP[i + 1]);
  const t = f - i;
  const c = a.map((v, k) => Math.round(v + (b[k] - v) * t));
  return `rgb(${c[0]}, ${c[1]}, ${c[2]})`;
}

// What a token looks like in a cell: whitespace made visible, never interpreted.
export function cellText(token) {
  if (token === null) return "?";
  const shown = token.replace(/\n/g, "\u21b5").replace(/\t/g, "\u21e5");
  return shown.trim() === "" ? shown.replace(/ /g, "\u2423") || "\u2205" : shown;
}

// The frames of one run. A frame is {canvas, step, committed, block: [start, end)}.
export class Run {
  constructor(blockLength, plannedSteps) {
    this.frames = [];
    this.blockLength = blockLength || null; // null: the server picked it; inferred per frame
    this.plannedSteps = plannedSteps || null;
    this.commitStep = []; // position -> server step (forward number) that committed it
  }

  get last() {
    return this.frames[this.frames.length - 1] || null;
  }

  add(canvas, step) {
    const prev = this.last;
    const fresh = [];
    canvas.forEach((token, i) => {
      const before = prev ? prev.canvas[i] : null;
      if (token !== null && (before === null || before === undefined)) {
        fresh.push(i);
        if (this.commitStep[i] === undefined) this.commitStep[i] = step;
      }
    });
    this.frames.push({ canvas, step, fresh, block: this.activeBlock(canvas, prev, fresh) });
  }

  // The block the step worked in: the one holding its new commits. With the block length
  // unknown, the span from the first position still masked before the step to its last commit.
  activeBlock(canvas, prev, fresh) {
    if (fresh.length === 0) return prev ? prev.block : [0, 0];
    const lo = Math.min(...fresh);
    const hi = Math.max(...fresh);
    if (this.blockLength) {
      const start = Math.floor(lo / this.blockLength) * this.blockLength;
      return [start, Math.min(canvas.length, start + this.blockLength)];
    }
    const firstMasked = prev ? prev.canvas.findIndex((t) => t === null) : 0;
    return [Math.min(firstMasked < 0 ? lo : firstMasked, lo), hi + 1];
  }

  // Highest step seen (or planned while running): what colours are scaled to.
  stepSpan(final) {
    const seen = this.last ? this.last.step : 1;
    return Math.max(1, final ? seen : Math.max(seen, this.plannedSteps || seen));
  }
}

// Draws frame `index` of `run` into `grid`, reusing cells between frames.
export function drawFrame(grid, run, index, final) {
  const frame = run.frames[index];
  if (!frame) return;
  const n = frame.canvas.length;
  while (grid.children.length < n) {
    const cell = document.createElement("span");
    cell.className = "cell";
    grid.appendChild(cell);
  }
  while (grid.children.length > n) grid.lastChild.remove();
  const span = run.stepSpan(final);
  const [bStart, bEnd] = frame.block;
  for (let i = 0; i < n; i++) {
    const cell = grid.children[i];
    const token = frame.canvas[i];
    cell.textContent = cellText(token);
    cell.classList.toggle("masked", token === null);
    cell.classList.toggle("in-block", i >= bStart && i < bEnd);
    cell.classList.toggle("fresh", frame.fresh.includes(i));
    if (token === null) {
      cell.style.backgroundColor = "";
      cell.style.color = "";
      cell.title = `position ${i}: masked`;
    } else {
      const step = run.commitStep[i] ?? frame.step;
      const fraction = span > 1 ? (step - 1) / (span - 1) : 0;
      cell.style.backgroundColor = stepColour(fraction);
      cell.style.color = fraction > 0.6 ? "#111" : "#fff";
      cell.title = `position ${i}: ${JSON.stringify(token)}, committed at step ${step}`;
    }
  }
}
