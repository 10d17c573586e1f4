// The example reward in Go (GOOS=wasip1, c-shared, //go:wasmexport): 1.0 when the last number
// in the completion equals metadata.answer, plus 0.1 when it contains "Answer:".
// Exports the core-module ABI v1; imports WASI preview 1, which the host links as deny-all
// stubs, and `_initialize`, which the host calls before `score`.
package main

import (
	"strings"
	"unsafe"
)

// Buffers handed to the host stay reachable here, so the GC never frees them.
var keep [][]byte
var details []byte

//go:wasmexport alloc
func alloc(n int32) int32 {
	buf := make([]byte, n+1)
	keep = append(keep, buf)
	return int32(uintptr(unsafe.Pointer(&buf[0])))
}

func text(ptr, n int32) string {
	if n <= 0 {
		return ""
	}
	return unsafe.String((*byte)(unsafe.Pointer(uintptr(ptr))), int(n))
}

func isDigit(c byte) bool { return c >= '0' && c <= '9' }
func isWs(c byte) bool    { return c == ' ' || c == '\t' || c == '\n' || c == '\r' }

func lastNumber(s string) (string, bool) {
	end := len(s) - 1
	for end >= 0 && !isDigit(s[end]) {
		end--
	}
	if end < 0 {
		return "", false
	}
	b := end
	for b > 0 && (isDigit(s[b-1]) || (s[b-1] == '.' && isDigit(s[b]))) {
		b--
	}
	if s[b] == '.' {
		b++
	}
	if b > 0 && s[b-1] == '-' {
		b--
	}
	return s[b : end+1], true
}

func answerField(j string) (string, bool) {
	k := strings.Index(j, `"answer"`)
	if k < 0 {
		return "", false
	}
	i := k + 8
	for i < len(j) && isWs(j[i]) {
		i++
	}
	if i >= len(j) || j[i] != ':' {
		return "", false
	}
	i++
	for i < len(j) && isWs(j[i]) {
		i++
	}
	if i < len(j) && j[i] == '"' {
		e := strings.IndexByte(j[i+1:], '"')
		if e < 0 {
			return "", false
		}
		return j[i+1 : i+1+e], true
	}
	b := i
	for i < len(j) && !isWs(j[i]) && j[i] != ',' && j[i] != '}' && j[i] != ']' {
		i++
	}
	return j[b:i], i > b
}

//go:wasmexport score
func score(pp, pl, cp, cl, mp, ml int32) float64 {
	c := text(cp, cl)
	m := text(mp, ml)
	got, okGot := lastNumber(c)
	want, okWant := answerField(m)
	correct := okGot && okWant && got == want
	if correct {
		details = []byte(`{"correct":true}`)
	} else {
		details = []byte(`{"correct":false}`)
	}
	bonus := 0.0
	if strings.Contains(c, "Answer:") {
		bonus = 0.1
	}
	base := 0.0
	if correct {
		base = 1.0
	}
	return base + bonus
}

//go:wasmexport details_ptr
func detailsPtr() int32 { return int32(uintptr(unsafe.Pointer(&details[0]))) }

//go:wasmexport details_len
func detailsLen() int32 { return int32(len(details)) }

//go:wasmexport anneal_reward_abi
func abiVersion() int32 { return 1 }

func main() {}
