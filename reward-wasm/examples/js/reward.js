// The example reward in JavaScript (a component built with componentize-js): 1.0 when the last
// number in the completion equals metadata.answer, plus 0.1 when it contains "Answer:".

const isDigit = (c) => c >= "0" && c <= "9";
const isWs = (c) => c === " " || c === "\t" || c === "\n" || c === "\r";

function lastNumber(s) {
  let end = s.length - 1;
  while (end >= 0 && !isDigit(s[end])) end--;
  if (end < 0) return null;
  let b = end;
  while (b > 0 && (isDigit(s[b - 1]) || (s[b - 1] === "." && isDigit(s[b])))) b--;
  if (s[b] === ".") b++;
  if (b > 0 && s[b - 1] === "-") b--;
  return s.slice(b, end + 1);
}

function answerField(j) {
  const k = j.indexOf('"answer"');
  if (k < 0) return null;
  let i = k + 8;
  while (i < j.length && isWs(j[i])) i++;
  if (i >= j.length || j[i] !== ":") return null;
  i++;
  while (i < j.length && isWs(j[i])) i++;
  if (i < j.length && j[i] === '"') {
    const e = j.indexOf('"', i + 1);
    return e < 0 ? null : j.slice(i + 1, e);
  }
  const b = i;
  while (i < j.length && !isWs(j[i]) && !",}]".includes(j[i])) i++;
  return i > b ? j.slice(b, i) : null;
}

export function score(prompt, completion, metadata) {
  const got = lastNumber(completion);
  const want = answerField(metadata);
  const correct = got !== null && want !== null && got === want;
  const bonus = completion.includes("Answer:") ? 0.1 : 0.0;
  return {
    score: (correct ? 1.0 : 0.0) + bonus,
    details: JSON.stringify({ correct }),
  };
}
